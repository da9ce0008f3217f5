"""The client side of docker/smoke.sh: talks to a running container through its published port with
the official openai SDK (as a user would), one subcommand per check. Each prints one line on success
and exits non-zero with the reason otherwise.

    python docker/smoke_client.py --url http://127.0.0.1:PORT wait-healthy --timeout 300 \\
        -- podman inspect --format '{{.State.Running}}' CTR
    python docker/smoke_client.py --url ... completion
    python docker/smoke_client.py --url ... chat-stream
    DOMINO_API_KEY=KEY python docker/smoke_client.py --url ... auth
    python docker/smoke_client.py --url ... drain --max-tokens 160 --limit 40 -- podman stop -t 40 CTR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

PROMPT = "Write a short story about a lighthouse keeper."


class CheckFailed(Exception):
    pass


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET without any proxy; HTTP error statuses are returned, not raised."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def client(args: argparse.Namespace, api_key: str | None = None) -> openai.OpenAI:
    # The SDK insists on some key; the server ignores it when DOMINO_API_KEY is unset.
    return openai.OpenAI(base_url=args.url + "/v1", api_key=api_key or args.api_key or "unused", max_retries=0)


def model_id(c: openai.OpenAI) -> str:
    models = [m.id for m in c.models.list().data]
    if len(models) != 1:
        raise CheckFailed(f"expected one served model, got {models}")
    return models[0]


def wait_healthy(args: argparse.Namespace) -> str:
    """Poll /health; with a state command (`podman inspect --format {{.State.Running}} CTR`), give up
    as soon as it says the container is no longer running instead of waiting out the timeout."""
    start = time.monotonic()
    last = "no answer"
    while time.monotonic() - start < args.timeout:
        if args.state_command:
            state = subprocess.run(args.state_command, capture_output=True, text=True, check=False)
            if state.stdout.strip() != "true":
                raise CheckFailed(f"the container stopped before /health answered 200 (last: {last})")
        try:
            status, _ = http_get(args.url + "/health")
            if status == 200:
                return f"/health answers 200 after {time.monotonic() - start:.1f} s"
            last = f"status {status}"
        except OSError as exc:  # the port is published before the server listens
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.25)
    raise CheckFailed(f"/health not 200 within {args.timeout:.0f} s (last: {last})")


def completion(args: argparse.Namespace) -> str:
    c = client(args)
    model = model_id(c)
    start = time.monotonic()
    out = c.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    took = time.monotonic() - start
    text = out.choices[0].text
    if not text.strip() or out.usage is None or out.usage.completion_tokens < 1:
        raise CheckFailed(f"empty completion: {out}")
    return f"completion from {model} ({out.usage.completion_tokens} tokens in {took:.2f} s): {text.strip()[:60]!r}"


def chat_stream(args: argparse.Namespace) -> str:
    c = client(args)
    model = model_id(c)
    start = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    finish = None
    usage = None
    stream = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if first is None:
                    first = time.monotonic() - start
                parts.append(choice.delta.content)
            finish = choice.finish_reason or finish
    total = time.monotonic() - start
    if first is None or not "".join(parts).strip():
        raise CheckFailed("the stream carried no content")
    if finish not in ("stop", "length") or usage is None:
        raise CheckFailed(f"the stream ended without a finish reason or usage (finish={finish}, usage={usage})")
    rate = usage.completion_tokens / max(total - first, 1e-9)
    return (
        f"first token {first * 1000:.0f} ms, {usage.completion_tokens} tokens in {total:.2f} s "
        f"({rate:.1f} tokens/s after the first), finish {finish}"
    )


def auth(args: argparse.Namespace) -> str:
    if not args.api_key:
        raise CheckFailed("auth needs --api-key (the DOMINO_API_KEY the container was started with)")
    for label, headers in (("no key", {}), ("a wrong key", {"Authorization": "Bearer wrong-" + args.api_key})):
        status, body = http_get(args.url + "/v1/models", headers)
        try:
            error = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            raise CheckFailed(f"/v1/models with {label}: not an OpenAI-style error: {body[:200]!r}") from None
        if status != 401 or not error.get("message"):
            raise CheckFailed(f"/v1/models with {label}: status {status}, {error}")
    try:
        client(args, api_key="wrong-" + args.api_key).models.list()
        raise CheckFailed("the SDK with a wrong key was let in")
    except openai.AuthenticationError:
        pass
    model = model_id(client(args))  # with the right key
    status, _ = http_get(args.url + "/health")  # probes need no key
    if status != 200:
        raise CheckFailed(f"/health answers {status} with a key set")
    return f"/v1/* needs the key: 401 without it or with a wrong one, {model} listed with it; /health open"


def drain(args: argparse.Namespace) -> str:
    """Start a long stream, run the stop command once the first token is in, and require the stream to
    finish whole (max_tokens reached, not cut) and the stop command to return 0 within the limit."""
    c = client(args)
    model = model_id(c)
    stopped: dict[str, object] = {}

    def stop() -> None:
        start = time.monotonic()
        proc = subprocess.run(args.stop_command, capture_output=True, text=True, check=False)
        stopped.update(rc=proc.returncode, seconds=time.monotonic() - start, err=proc.stderr.strip())

    stopper = threading.Thread(target=stop)
    tokens = 0
    finish = None
    usage = None
    stream = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        # Generate to max_tokens whatever the text, so "finished whole" is exactly "length".
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                tokens += 1
                if not stopper.is_alive() and not stopped:
                    stopper.start()  # SIGTERM while this stream is in flight
            finish = choice.finish_reason or finish
    stopper.join(args.limit + 30)
    if not stopped:
        raise CheckFailed(f"`{' '.join(args.stop_command)}` did not return")
    if finish != "length" or usage is None or usage.completion_tokens != args.max_tokens:
        raise CheckFailed(f"the in-flight stream was cut: finish={finish}, usage={usage}, {tokens} content chunks")
    if stopped["rc"] != 0 or float(stopped["seconds"]) > args.limit:  # type: ignore[arg-type]
        raise CheckFailed(f"stop: exit {stopped['rc']} after {stopped['seconds']:.1f} s: {stopped['err']}")
    return (
        f"SIGTERM drained the in-flight stream ({usage.completion_tokens}/{args.max_tokens} tokens, finish "
        f"length); stop returned after {stopped['seconds']:.1f} s (limit {args.limit:.0f} s)"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="http://127.0.0.1:PORT (the published port)")
    parser.add_argument("--api-key", default=os.environ.get("DOMINO_API_KEY"), help="default: $DOMINO_API_KEY")
    sub = parser.add_subparsers(dest="check", required=True)
    p = sub.add_parser("wait-healthy")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("state_command", nargs="*", help="prints true while the container runs (after --)")
    sub.add_parser("completion")
    sub.add_parser("chat-stream")
    sub.add_parser("auth")
    p = sub.add_parser("drain")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--limit", type=float, default=40, help="seconds the stop command may take")
    p.add_argument("stop_command", nargs="+", help="e.g. podman stop -t 40 CONTAINER (after --)")
    args = parser.parse_args(argv)
    checks = {
        "wait-healthy": wait_healthy,
        "completion": completion,
        "chat-stream": chat_stream,
        "auth": auth,
        "drain": drain,
    }
    try:
        print(checks[args.check](args))
    except (CheckFailed, openai.OpenAIError) as exc:
        print(f"{args.check}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
