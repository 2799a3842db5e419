"""The run: one federated run's rules and the conductor that carries them out.

``state`` holds the run as a frozen value with pure transitions and their effects; ``conductor.Run`` holds the
lock and dispatches every effect (persist, fold, close, duplicate, refusal) to its collaborators: the ``Journal``
(``hetfed.aggregator.journal``), the ``Aggregation`` of the server half (``aggregation``) and an observer.
Admission checks, the instructions' cache, the ``ChangeNotifier`` that wakes long-polls (``notifier``), the
organizations' ledger and Status's view live here too. The pure core (``state``, ``admission``, ``resume``,
``instructions``) imports no gRPC.
"""
