"""Drafter training (docs/design.md §1.5). `cli` turns `domino-train`'s flags into the typed configs
of `config`; `gen` regenerates answers into `shards` (prompts from `data`), `features` stores the
target's features once, `samples` serves them to `fit` (drafters from `init`, the objective in
`loss`), and `evaluate` measures acceptance."""
