"""The networks: the target run over ragged rows (`target`), the Domino drafter (`drafter`) and the
attention kernel they share (`attention`)."""
