"""The native pickle cost scan (reshard/storage/pickles/costscan.c) answers exactly as the Python one.

`safe_pickle.pickle_cost` runs the C scan when it is built and `python_pickle_cost` is the
reference it replaces (40-80 times slower on `.metadata` at frontier scale). The scan is a
security boundary, so the two are compared outcome for outcome — the same cost, or the same
refusal with the same message — on:

- pickles of random shared structures at every protocol, under budgets from 0 to above
  their cost (so every "over budget" check is reached at some point of the stream);
- a real `.metadata` written by ``dcp.save`` and a real ``torch.save`` pickle, and random
  mutations of both (flipped, inserted and deleted bytes, truncations): malformed input
  reaches every refusal path;
- hand-made hostile bodies: memo indices far beyond the dense memo, a memo grown in steps,
  claims of huge lengths, self-reference, unknown opcodes.
"""
from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.storage.pickles.safe_pickle import PickleTooCostly, native_scan, pickle_budget, pickle_cost, python_pickle_cost


def outcome(fn, data: bytes, limit: int) -> tuple[str, object]:
    try:
        return ("cost", fn(data, limit=limit))
    except PickleTooCostly as exc:
        return ("refused", str(exc))


def same(data: bytes, limit: int) -> tuple[str, object]:
    a, b = outcome(pickle_cost, data, limit), outcome(python_pickle_cost, data, limit)
    assert a == b, (data[:80], limit)
    return a


def test_the_native_scan_is_built():
    """The install builds it (setup.py; gcc is part of the machine): a silent fallback would cost 40x."""
    assert native_scan is not None


def _structures():
    leaves = st.one_of(st.integers(-2**70, 2**70), st.text(max_size=30), st.binary(max_size=30), st.none(),
                       st.booleans(), st.floats(allow_nan=False))

    def extend(children):
        return st.one_of(st.lists(children, max_size=5), st.tuples(children, children), st.tuples(children),
                         st.tuples(children, children, children), st.frozensets(st.integers(0, 9), max_size=4),
                         st.sets(st.text(max_size=4), max_size=4),
                         st.dictionaries(st.text(max_size=6), children, max_size=4),
                         st.tuples(children, st.integers(1, 30)).map(lambda p: [p[0]] * p[1]))
    return st.recursive(leaves, extend, max_leaves=30)


@settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=_structures(), protocol=st.integers(0, 5), frac=st.floats(0, 1.2))
def test_random_pickles_at_every_protocol_and_budget(obj, protocol, frac):
    data = pickle.dumps(obj, protocol=protocol)
    kind, cost = same(data, 10**12)
    assert kind == "cost"
    same(data, int(cost * frac))  # budgets below the cost refuse at the same opcode in both


@pytest.fixture(scope="module")
def real_pickles(tmp_path_factory) -> list[bytes]:
    from reshard.testing.synthetic import make_many_entries

    ck = make_many_entries(tmp_path_factory.mktemp("costscan") / "many", 40)
    buf = io.BytesIO()
    torch.save({"step": torch.tensor(3), "groups": [{"lr": 0.1, "params": [0, 1]}]}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        data_pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return [(ck / ".metadata").read_bytes(), data_pkl]


def test_real_pickles_cost_the_same(real_pickles):
    for data in real_pickles:
        kind, cost = same(data, pickle_budget(len(data)))
        assert kind == "cost" and cost > 0


@settings(max_examples=400, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 1), edits=st.lists(st.tuples(st.sampled_from("flip insert delete"), st.floats(0, 1),
                                                         st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.floats(0, 1)))
def test_mutated_real_pickles_are_judged_the_same(real_pickles, which, edits, cut):
    data = bytearray(real_pickles[which])
    for kind, where, byte in edits:
        i = min(int(where * len(data)), len(data) - 1)
        if kind == "flip":
            data[i] = byte
        elif kind == "insert":
            data.insert(i, byte)
        else:
            del data[i]
    if cut is not None:
        del data[int(cut * len(data)):]
    same(bytes(data), pickle_budget(len(data)))


@pytest.mark.parametrize("body", [
    b"\x80\x04]\x94r\x00\x00\x00\x40.",                       # LONG_BINPUT 2**30: beyond the pickle
    b"\x80\x02]r\x00\x01\x00\x00" + b"N" * 300 + b"0h\x00.",   # BINPUT 65,536 (sparse memo), then a BINGET miss
    b"\x80\x02]r\x00\x00\x02\x00j\x00\x00\x02\x00." + b"\x00" * (1 << 17),  # a sparse put, then its get
    # a sparse put at 100,000, the dense memo grown over it by later puts, then a reference to it and a change
    b"\x80\x02]r\xa0\x86\x01\x00]r\x60\xea\x00\x00]r\xf0\x49\x02\x00j\xa0\x86\x01\x00Na." + b"\x00" * 200_000,
    b"\x80\x02" + b"".join(b"]r" + (i * 60000).to_bytes(4, "little") for i in range(40)) + b"(" + b"j" + (39 * 60000).to_bytes(4, "little") + b"t." + b"\x00" * (40 * 60000),
    b"\x80\x04\x8e\xff\xff\xff\xff\xff\x00\x00\x00.",         # BINBYTES8 claiming a terabyte
    b"\x80\x04\x95\xff\xff\xff\xff\x00\x00\x00\x00N.",         # a FRAME longer than the pickle
    b"\x80\x04\x95\x01\x00",                                   # a truncated FRAME length
    b"\x80\x04]\x94h\x00a.",                                  # a list appended to itself after a memo reference
    b"\x80\x04]\x942a.",                                      # ... after DUP
    b"\x80\x04\x82\x01.",                                     # EXT1
    b"\x80\x04\xff.",                                         # no such opcode
    b"\x80\x04(N\x85.",                                       # TUPLE1 right after MARK
    b"\x80\x04(0N.",                                          # POP of a MARK
    b"\x80\x04N(1.",                                          # POP_MARK, then STOP on None
    b"\x80\x04(NNNu.",                                        # SETITEMS with an odd count
    b"\x80\x04}(NNNNu.", b"\x80\x04Ns.", b"\x80\x04(o.", b"\x80\x04)\x81.", b"\x80\x04NNN\x92.",
    b"\x80\x04NNb.", b"\x80\x04]Nb.", b"\x80\x04J\x01\x00", b"\x80\x04h", b"\x80\x04j\x00\x00", b"\x80\x04]q",
    b"\x80\x04T\xff\xff\xff\xffN.",                           # BINSTRING with a negative length
    b"(I1\nI2\nt.",                                           # protocol 0: scanned in Python
    b"",
])
def test_hostile_bodies_are_judged_the_same(body):
    for limit in (0, 5, pickle_budget(len(body))):
        same(body, limit)
