"""The compiled matcher (`conventions.classify`: every rule in one RE2 set, candidates scored over
columns) classifies exactly as the conventions' rules asked one by one did (issue 45).

The reference below is the per-key, per-convention algorithm `classify` had before: each
convention's `Convention.classify` on each key, with and without catch-alls, combined per
candidate primary. Keys: a real `.metadata` (a small MoE saved as `get_state_dict` by the
frontier builder, and `dcp.save`'s own in the plain FSDP2 fixture) and a few hundred synthetic
keys made from every shipped convention file's rules, alone, in subsets (other primaries win)
and with a user convention. Cost: about 2 s (no checkpoint is trained).
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from reshard.semantics import conventions as conv_mod
from reshard.semantics.conventions import Convention, KeyRole, builtin_conventions, classify, load_user_convention, \
    map_indexed_optimizer
from reshard.storage.checkpoints.local_format import open_any


def reference_classify(keys, *, prefer=None, user=()):
    """`classify` as it was: every convention asked about every key (the rules one by one)."""
    keys = list(keys)
    shipped = [c for c in builtin_conventions() if not c.generic]
    convs = list(user) + shipped
    generic = [c for c in builtin_conventions() if c.generic]
    full = {id(c): [c.classify(k, kind) for k, kind in keys] for c in convs}
    comp = {id(c): [c.classify(k, kind, composed=True) for k, kind in keys] for c in convs + generic}

    def one(i, primary, others, first):
        for c in others[:first]:
            r = comp[id(c)][i]
            if r.role != "unknown":
                return r
        r = full[id(primary)][i]
        for c in others[first:]:
            if r.role != "unknown":
                break
            r = comp[id(c)][i]
        return r

    scored = []
    for conv in convs:
        first = tuple(c for c in user if c is not conv)
        others = first + tuple(c for c in shipped if c is not conv) + tuple(generic)
        roles = {k: one(i, conv, others, len(first)) for i, (k, _kind) in enumerate(keys)}
        roles = map_indexed_optimizer(roles, (conv, *others))
        unknown = sum(1 for r in roles.values() if r.role == "unknown")
        params = {r.param for r in roles.values() if r.role == "parameter"}
        orphans = sum(1 for r in roles.values() if r.role in ("optimizer_moment", "optimizer_step")
                      and params and r.param not in params)
        markers = conv.markers_in([k for k, _ in keys])
        lent = sum(1 for r in roles.values() if r.convention not in (None, conv.name))
        stolen = sum(1 for i, (k, kind) in enumerate(keys)
                     if (rule := conv.first_rule(k, kind)) is not None and rule.catch_all
                     and any(comp[id(o)][i].role != "unknown" for o in others))
        scored.append(((markers == 0, unknown, stolen, orphans, lent, -markers, -conv.priority), conv, roles, unknown, others))
    scored.sort(key=lambda s: s[0])
    if prefer:
        for s in scored:
            if s[1].name == prefer:
                scored.remove(s)
                scored.insert(0, s)
                break
    _, conv, roles, _, others = scored[0]
    return conv_mod.Classification(conv, roles, [(s[1].name, s[3]) for s in scored], others)


def assert_same(keys, **kw):
    got, want = classify(keys, **kw), reference_classify(keys, **kw)
    assert got.convention.name == want.convention.name
    assert got.candidates == want.candidates
    assert [c.name for c in got.composed] == [c.name for c in want.composed]
    assert list(got.roles) == list(want.roles)
    bad = [(k, got.roles[k], want.roles[k]) for k in want.roles if got.roles[k] != want.roles[k]]
    assert not bad, bad[:5]
    assert all(isinstance(r, KeyRole) for r in got.roles.values())
    return got


def synthetic_keys() -> list[tuple[str, str]]:
    """Keys made from every shipped convention's rules: each rule's literal prefix (``^model\\.`` ->
    ``model.``) and markers', joined to parameter names, optimizer suffixes, indices and ranks."""
    prefixes = {""}
    for c in builtin_conventions():
        for p in [r.pattern.pattern for r in c.rules] + [m.pattern for m in c.markers]:
            m = re.match(r"\^((?:\\.|[A-Za-z0-9_])*)", p)
            if m:
                prefixes.add(re.sub(r"\\(.)", r"\1", m.group(1)))
    middles = ["layers.0.attention.wq.weight", "tok_embeddings.weight", "3", "bn.running_mean",
               "decoder.layers.1.mlp._extra_state/shard_0.0_1.1", "weird/key", "7.exp_avg", "0"]
    suffixes = ["", ".step", ".exp_avg", ".exp_avg_sq", ".state.0.step", ".state.0.exp_avg", ".lr", ".params"]
    keys = {p + m + s for p in prefixes for m in middles for s in suffixes}
    keys |= {p.rstrip("._") for p in prefixes} | {"step", "epoch", "global_step", "epochs_run", "seed", "lr_scheduler",
                                                  "scheduler.last_epoch", "rng.rank_01", "rng.rank_1", "extra.blob",
                                                  "config.model", "trainer.step", "data.sampler.cursor", "dataloader.dp_rank_2"}
    rnd = random.Random(45)
    return [(k, rnd.choice(("tensor", "object"))) for k in sorted(keys)]


def test_synthetic_keys_of_every_convention():
    keys = synthetic_keys()
    assert len(keys) > 300
    assert_same(keys)
    rnd = random.Random(1)
    winners = set()
    for c in builtin_conventions():  # subsets holding one convention's markers, so that others become the primary
        own = [k for k in keys if any(m.search(k[0]) for m in c.markers)]
        sub = rnd.sample(own, min(len(own), 60)) + rnd.sample(keys, 5)
        winners.add(assert_same(sub).convention.name)
    assert len(winners) > 3, winners
    for c in builtin_conventions():
        if not c.generic:
            assert_same(keys[:80], prefer=c.name)


def test_user_convention_first(tmp_path: Path):
    f = tmp_path / "mine.toml"
    f.write_text('name = "mine"\nmarkers = [\'^model\\\\.\']\n'
                 '[[rule]]\nmatch = \'^model\\\\.(?P<param>.+)\\\\.weight$\'\nrole = "other"\n'
                 '[[rule]]\nmatch = \'^(?P<param>[^/]+)$\'\nrole = "parameter"\ncatch_all = true\n')
    user = (load_user_convention(f).convention,)
    keys = synthetic_keys()
    assert_same(keys, user=user)
    assert_same([k for k in keys if k[0].startswith(("model.", "optim."))], user=user)


def test_real_metadata_keys(tmp_path: Path, plain_fsdp2_ckpt: Path):
    from reshard.testing import synthetic_metadata as sm

    params = [("tok.weight", (64, 8), 0)] + [(f"layers.{i}.moe.experts.{e}.w{j}.weight", (8, 8), 0)
                                            for i in range(2) for e in range(8) for j in (1, 2, 3)]
    sm.make_checkpoint(tmp_path / "moe", sm.model_entries(params), dp=2)
    for root in (tmp_path / "moe", plain_fsdp2_ckpt):
        ix = open_any(root)
        keys = [(k, e.kind) for k, e in ix.entries.items()]
        assert assert_same(keys).convention.name == "torch-get-state-dict"


def test_one_matcher_per_set_of_conventions():
    convs = tuple(builtin_conventions())
    assert conv_mod.Matcher.of(convs) is conv_mod.Matcher.of(convs)
    assert isinstance(convs[0], Convention)


@pytest.mark.parametrize("key", ["model.\u00e9t\u00e9.weight", "optim.state.\u00fc.exp_avg"])
def test_non_ascii_keys(key):
    assert_same([(key, "tensor"), ("model.a", "tensor")])
