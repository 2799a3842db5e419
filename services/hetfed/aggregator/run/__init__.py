"""The run: one federated run's rules and the shell that carries them out.

``state`` holds the run as a frozen value with pure transitions and their effects; ``shell.Run`` holds the lock
and dispatches every effect (persist, fold, close, duplicate, refusal) to its collaborators: the ``Journal``
(``hetfed.aggregator.journal``), the ``Keeper`` of the server half (``keeper``) and an observer. Admission
checks, the instructions' cache, wake-ups, the organizations' ledger and Status's view live here too.
"""
