"""The FedAvg family's weights on the wire side of a client: sent from views of the model, loaded in place."""

from __future__ import annotations

import numpy as np
import torch

from hetfed.client.algorithms.fedavg import load_shared_state, model_weights, shared_state
from hetfed.wire import messages
from hetfed.wire.payloads import ModelWeights
from hetfed.wire.phases import Action
from hetfed.wire.specs import get_spec


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))


def test_model_weights_are_views_of_the_models_tensors() -> None:
    m = model()
    weights = model_weights(m, 5)
    state = shared_state(m)
    assert list(weights.tensors) == list(state)  # floating entries only: num_batches_tracked is int64
    assert "1.num_batches_tracked" not in weights.tensors
    for name, arr in weights.tensors.items():
        assert np.shares_memory(arr, state[name].numpy()), name  # no copy before the serializer
    first = m[0]
    assert isinstance(first, torch.nn.Linear)
    with torch.no_grad():
        first.weight[0, 0] = 42.0
    assert weights.tensors["0.weight"][0, 0] == 42.0


def test_received_weights_are_loaded_into_the_models_memory() -> None:
    sent, received = model(), model()
    with torch.no_grad():
        for v in shared_state(sent).values():
            v.add_(1.5)
    ins = messages.Instructions("r", 2, Action.EVALUATE, 2, payloads=[model_weights(sent, 0)])
    decoded, _ = messages.decode_instructions(messages.encode_instructions(ins).data, get_spec("fedavg"))
    got = decoded.payloads[0]
    assert isinstance(got, ModelWeights)
    before = {k: v.data_ptr() for k, v in shared_state(received).items()}
    load_shared_state(received, got)
    for name, v in shared_state(received).items():
        assert v.data_ptr() == before[name], name  # written in place
        assert torch.equal(v, shared_state(sent)[name]), name
