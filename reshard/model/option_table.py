"""The options of ``plan``, ``convert`` and ``inspect``, declared once: one `OptionSpec` per flag.

A plan option used to be spelled in seven places (two typer signatures, two option calls, the
``convert --plan`` check, `Given`, `Options`), and a flag forgotten in one of them was a flag
that silently did nothing there. Everything that names these flags is built from `OPTIONS`:

* the typer parameters of the three verbs (`reshard.cli_parse.takes_options`), in table order,
  which is the order ``--help`` lists them in;
* the check that ``convert --plan P`` refuses a plan option (`reshard.arguments.check_beside_plan`);
* `reshard.planning.options.Given` and the `Given` a command line or an API call makes
  (`reshard.planning.options.given_from`), and the plain fields `build_options` copies to `Options`;
* the Python API's keyword options (`reshard.api.PlanOptions`, its checks of choices and bounds).

A new plan flag is then a row here and, where the plan reads it, a field of `Options`
(`tests/test_option_table.py` checks that nothing else spells it). Plain data: nothing here
imports typer, torch or any layer above the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field as _field
from pathlib import Path
from typing import Any, Mapping

from reshard.model.kinds import DATA_POLICIES, DTYPES, ONLY, RNG_POLICIES, SCHEDULE_POLICIES, OutputFormat

REQUIRED: Any = ...
"""The default of an option that must be given (typer's ``...``)."""

PLAN_VERBS = frozenset({"plan", "convert"})


@dataclass(frozen=True)
class OptionSpec:
    """One flag of the table: how it is parsed, what ``--help`` says, and where its value goes."""

    name: str                            # the keyword: CLI parameter, API keyword (`PlanOptions` key)
    flag: str                            # the command line's spelling, e.g. "--micro-batch"
    type: type                           # of one value: str, int, bool or Path
    help: str
    default: Any = None                  # None / False: not given; REQUIRED: must be given
    repeatable: bool = False             # a list of values, the flag given once per value
    choices: tuple[str, ...] | None = None  # the values it takes (from model/kinds.py), listed in --help
    min: int | None = None               # the least value of an int
    verbs: frozenset[str] = PLAN_VERBS   # the commands that take it
    plan: bool = True                    # a plan option: it changes the plan, so `convert --plan` refuses it
    field: str | None = None             # its `Given` field (None: the flag goes to no `Given`)
    copied: bool = False                 # `build_options` copies it to the `Options` field of that name as given
    per_verb: Mapping[str, Mapping[str, Any]] = _field(default_factory=dict)  # help / default where a verb differs

    def help_for(self, verb: str) -> str:
        return self.per_verb.get(verb, {}).get("help", self.help)

    def default_for(self, verb: str) -> Any:
        return self.per_verb.get(verb, {}).get("default", self.default)

    def given(self, value: Any) -> bool:
        """Whether ``value`` says the flag was given: None, False and an empty list say not
        (0 is a value: ``--seed 0``)."""
        return value is not None and value is not False and not (isinstance(value, (list, tuple)) and not value)


_TRUST_HELP = ("Allow object items (never tensor items) to unpickle arbitrary classes, which can run code: only for "
               "sources you trust; the items unpickled are named on stderr.")
_INSPECT = frozenset({"inspect", "plan", "convert"})

OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec("to", "--to", str, "Target layout (or give --plan).", plan=False, field="to",
               per_verb={"plan": {"default": REQUIRED, "help": "Target layout, e.g. dp=32 or dp_shard=16,dp_replicate=2."}}),
    OptionSpec("from_spec", "--from", str, "Override the source topology.", verbs=_INSPECT, field="from_spec",
               per_verb={"inspect": {"help": "Override the writer topology, e.g. dp_shard=4,tp=2."}}),
    OptionSpec("micro_batch", "--micro-batch", int, "Target micro-batch (default: the source's).", min=1,
               field="micro_batch", copied=True),
    OptionSpec("grad_accum", "--grad-accum", int, "Target accumulation (default: what keeps the global batch).", min=1,
               field="grad_accum", copied=True),
    OptionSpec("source_micro_batch", "--source-micro-batch", int,
               "The source run's micro-batch, when no manifest records it.", min=1, field="source_micro_batch"),
    OptionSpec("source_grad_accum", "--source-grad-accum", int,
               "The source run's accumulation, when no manifest records it.", min=1, field="source_grad_accum"),
    OptionSpec("source_seq_len", "--source-seq-len", int,
               "The source run's tokens per sample (for --schedule tokens from a token counter).", min=1,
               field="source_seq_len"),
    OptionSpec("schedule", "--schedule", str, "How the LR schedule maps when the global batch changes.",
               choices=SCHEDULE_POLICIES, field="schedule", copied=True),
    OptionSpec("data_policy", "--data-policy", str, "What becomes of per-rank data-loader state.",
               choices=DATA_POLICIES, field="data_policy", copied=True),
    OptionSpec("rng_policy", "--rng-policy", str,
               "RNG state (default: carry when every rank keeps its position, else reseed).", choices=RNG_POLICIES,
               field="rng_policy", copied=True),
    OptionSpec("seed", "--seed", int, "Seed for reseeding RNG (default: the manifest's).", min=0, field="seed",
               copied=True),
    OptionSpec("trust_pickle", "--trust-pickle", bool, _TRUST_HELP, default=False, verbs=_INSPECT,
               field="trust_pickle", copied=True),
    OptionSpec("rules", "--rules", Path, "Partition rules for TP/PP changes: a shipped family (llama-torchtitan, "
               "llama-fused, megatron-gpt, reference-gpt) or a rules TOML file.", field="rules"),
    OptionSpec("model_config", "--model-config", str,
               "Model size for the rules, name=integer (repeatable), e.g. n_heads=8.", repeatable=True,
               field="model_config"),
    OptionSpec("pp_stages", "--pp-stages", str,
               "Explicit layers per target pipeline stage, inclusive ranges: 0-2,3-5.", field="pp_stages", copied=True),
    OptionSpec("convention", "--convention", Path, "A key convention TOML of your own (the format of "
               "formats/conventions/*.toml), repeatable: its rules win for the keys they match; recorded by name and "
               "sha256.", repeatable=True, verbs=_INSPECT, field="conventions"),
    OptionSpec("keep", "--keep", str, "PATTERN[=REASON]: carry unknown keys matching this regex (on the flat key) "
               "unchanged, role other (repeatable).", repeatable=True, field="keep"),
    OptionSpec("drop", "--drop", str, "PATTERN[=REASON]: leave unknown keys matching this regex (on the flat key) out "
               "of the output (repeatable); the reason is recorded.", repeatable=True, field="drop"),
    OptionSpec("tie", "--tie", str, "A=B: parameters A and B are one tensor saved under two names (repeatable), "
               "checked equal like a manifest's model.tied.", repeatable=True, verbs=_INSPECT, field="ties"),
    OptionSpec("source_global_batch", "--source-global-batch", int, "The source run's global batch, when no manifest "
               "records it (the accumulation follows from the dp degree).", min=1, field="source_global_batch"),
    OptionSpec("profile", "--profile", Path, "A profile TOML saying what this trainer's checkpoints mean (default: "
               "./reshard.toml, else reshard.toml beside the checkpoint).", verbs=_INSPECT, field="profile"),
    OptionSpec("no_profile", "--no-profile", bool,
               "Read no reshard.toml found in the working directory or beside the checkpoint.", default=False,
               verbs=_INSPECT, field="no_profile"),
    OptionSpec("trainer_config", "--trainer-config", Path, "The trainer's own config (torchtitan's saved config JSON "
               "or job TOML): the source recipe and head counts.", field="trainer_config"),
    OptionSpec("layers", "--layers", str, "A slice of the model: keep these layers (0-1, or 0,5,79), renumbered "
               "densely, with their optimizer state (the family's [pipeline] says what a layer is).", field="layers",
               copied=True),
    OptionSpec("experts", "--experts", str, "A slice of each MoE layer: keep these experts, renumbered densely (only "
               "for a family that declares [experts]).", field="experts", copied=True),
    OptionSpec("output_format", "--output-format", str,
               "dcp (a DCP checkpoint) or local (one safetensors file per target rank).", default="dcp",
               choices=tuple(OutputFormat), verbs=frozenset({"convert"}), plan=False),
    OptionSpec("dtype", "--dtype", str, "Reduced copy for testing: cast parameters and moments (bf16, fp16, fp32).",
               choices=DTYPES, verbs=frozenset({"convert"}), field="dtype", copied=True),
    OptionSpec("only", "--only", str, "Reduced copy for testing: model (drop optimizer state) or model+optim.",
               choices=ONLY, verbs=frozenset({"convert"}), field="only", copied=True),
)
"""Every option, in the order ``--help`` lists them (each verb takes its own, in this order)."""

BY_NAME: dict[str, OptionSpec] = {spec.name: spec for spec in OPTIONS}

PLAN_OPTIONS: tuple[OptionSpec, ...] = tuple(spec for spec in OPTIONS if spec.plan)
"""The options a plan is made with: refused beside ``convert --plan``, the API's `PlanOptions`."""

def for_verb(verb: str) -> tuple[OptionSpec, ...]:
    """The options ``verb`` takes, in table order."""
    return tuple(spec for spec in OPTIONS if verb in spec.verbs)


def flag(name: str) -> str:
    """The command-line spelling of option ``name`` (``from_spec`` -> ``--from``)."""
    return BY_NAME[name].flag
