"""The decoding runtime: the step loop (`engine`), its settings (`config`), admission (`scheduler`),
proposers, the draft policy and its costs, the rejection sampler, sampling, logits processors and
grammars, static (CUDA-graph) shapes, and what a request asks and gets back (`requests`, torch-free).

Nothing is imported here: the API imports `model.engine.requests` without torch."""
