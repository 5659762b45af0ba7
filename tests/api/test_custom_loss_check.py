"""The custom-loss check on hostile input (hypothesis): whatever JSON a client uploads as a graph, the check answers
a CheckedLoss or a CustomLossError (a `user` failure naming the node), never another exception (which the API would
turn into a 500), and what it accepts round-trips through its canonical source unchanged."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinkerflow.common import custom_loss_graph
from tinkerflow.common.custom_loss_allowlist import SIGNATURES

NAMES = st.sampled_from(["logprobs", "a", "b", "c", "out", "x"])
TARGETS = st.sampled_from(
    [
        "torch.exp",
        "operator.add",
        "operator.getitem",
        "sum",
        "mean",
        "getattr",
        "torch.where",
        "torch.zeros",
        "os.system",
        "exp_",
        "logprobs",
        "output",
        "",
        "torch.nn.functional.softmax",
        *SIGNATURES,
    ]
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=8)
)
ENCODED = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.fixed_dictionaries({"ref": NAMES}),
        st.fixed_dictionaries({"tuple": st.lists(inner, max_size=3)}),
        st.fixed_dictionaries({"dict": st.dictionaries(st.text(max_size=12), inner, max_size=2)}),
        st.fixed_dictionaries({"slice": st.lists(inner, min_size=0, max_size=4)}),
        st.fixed_dictionaries({"dtype": st.sampled_from(["float32", "int64", "complex64", "x"])}),
        st.fixed_dictionaries({"float": st.sampled_from(["inf", "-inf", "nan", "1"])}),
        st.dictionaries(st.text(max_size=6), inner, max_size=2),
    ),
    max_leaves=12,
)
NODE = st.fixed_dictionaries(
    {
        "op": st.sampled_from(
            ["placeholder", "call_function", "call_method", "output", "get_attr", "call_module", "x"]
        ),
        "name": NAMES,
        "target": TARGETS,
        "args": st.one_of(st.lists(ENCODED, max_size=3), ENCODED),
        "kwargs": st.one_of(
            st.dictionaries(st.sampled_from(["dim", "keepdim", "min", "out", "inplace"]), ENCODED, max_size=2), ENCODED
        ),
    }
)
INPUTS = st.one_of(
    st.just([{"name": "logprobs", "rank": 1}]),
    st.lists(st.fixed_dictionaries({"name": NAMES, "rank": st.one_of(st.integers(-1, 3), st.booleans())}), max_size=3),
    ENCODED,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.one_of(st.text(max_size=20), SCALARS), inputs=INPUTS, nodes=st.one_of(st.lists(NODE, max_size=6), ENCODED)
)
def test_any_upload_is_checked_or_refused_by_name(name, inputs, nodes):
    try:
        checked = custom_loss_graph.check(name, inputs, nodes)
    except custom_loss_graph.CustomLossError as e:
        assert str(e).startswith("custom loss")
        return
    assert custom_loss_graph.from_source(checked.source) == checked
