"""``flce-policy``: see what the probe sees, explain a decision, validate a policy file, benchmark.

User errors (bad YAML, unknown strategy or device, bad numbers) print one line per problem on
stderr and exit 2, never a traceback. They are told apart where user input is parsed: the argument
types, :func:`_problem`, :func:`_policy` and :func:`_device` turn the library's ValueErrors into
usage errors naming the option, and policy files and strategies raise their own ConfigError and
StrategyError; :func:`main` catches only those, so any other exception is a bug and keeps its
traceback. ``--json`` prints machine-readable JSON on stdout: for
``explain`` one decision object (``chunk_size``, ``num_chunks``, ``slab_bytes``, ...) for one device,
or ``{"problem", "policy", "decisions": [...]}`` for the known-GPU table. The active policy is
``--config FILE``, else the file ``$FLCE_POLICY_CONFIG`` names, else the packaged default.
``bench`` hands its arguments to ``flce_policy.benchmarks.cli`` (see ``flce-policy bench --help``), ``tune``
to ``flce_policy.cli.tune`` (see ``flce-policy tune --help``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from flce_policy.engine.config import CONFIG_VERSION, ConfigError, load_yaml_text
from flce_policy.engine.policy import CONFIG_ENV_VAR, FLCEPolicy
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.problem import Problem, checked_dtype, vocab_shard_sizes
from flce_policy.plan.units import format_bytes
from flce_policy.strategies import BUILTIN_STRATEGIES, StrategyError, strategy_from_config

__all__ = ["main", "MODEL_PRESETS"]


class ModelPreset(NamedTuple):
    vocab: int
    hidden: int
    #: the config's ``final_logit_softcapping`` (None: no softcap)
    softcap: float | None = None


#: LM-head shapes (vocab V, hidden H, softcap) of common models, for ``--model``.
MODEL_PRESETS: dict[str, ModelPreset] = {
    "llama-3-8b": ModelPreset(128256, 4096),
    "llama-3-70b": ModelPreset(128256, 8192),
    "llama-3.1-405b": ModelPreset(128256, 16384),
    "gemma-2-9b": ModelPreset(256000, 3584, 30.0),
    "gemma-3-27b": ModelPreset(262208, 5376),
    "gemma-4-31b": ModelPreset(262144, 5376, 30.0),
    "qwen-2.5-7b": ModelPreset(152064, 3584),
    "qwen-2.5-72b": ModelPreset(152064, 8192),
    "mistral-7b": ModelPreset(32768, 4096),
}
DEFAULT_TOKENS = 8192
_VALIDATE_MODEL = "gemma-4-31b"


class _UsageError(Exception):
    """A bad command line; main prints it on one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse would print the whole usage block and exit; one line is easier to read and to test.
        raise _UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 user error)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except (_UsageError, ConfigError, StrategyError, OSError) as err:
        # What the user gave is wrong: the command line, a policy file, a strategy and its parameters
        # (and what they decide for the problem), a file to read or write. Anything else is a bug of
        # ours and keeps its traceback; user input is checked where it is parsed (_problem, _policy,
        # _device, the argument types), so library errors reach here only as these types.
        return _fail(str(err))


def _fail(message: str) -> int:
    for line in message.splitlines() or [""]:
        print(f"error: {line}", file=sys.stderr)
    return 2


# --- arguments -----------------------------------------------------------------------------------


#: The largest size the CLI takes: a tensor dimension is an int64.
_MAX_SIZE = 2**63 - 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # not a number, or more digits than Python converts
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {_shown(text)}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if value > _MAX_SIZE:
        raise argparse.ArgumentTypeError(
            f"expected at most 2**63 - 1 (a tensor dimension is an int64), got {_shown(text)}"
        )
    return value


def _shown(text: str) -> str:
    """``text`` quoted for an error line, cut short when it is long (a 400-digit number)."""
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"


def _softcap(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {_shown(text)}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a positive finite softcap (0: none), got {_shown(text)}")
    return value


def _master_dtype(text: str) -> str:
    try:
        return checked_dtype(text, "a dtype")  # the dtypes the memory model knows: the one rule for all
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _build_parser() -> _Parser:
    parser = _Parser(prog="flce-policy", description="GPU-aware chunk geometry for fused linear cross-entropy.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{probe,explain,validate,cache,bench,tune}")

    probe = sub.add_parser("probe", help="what the device probe sees, and which rule of the active policy applies")
    probe.add_argument("--config", metavar="FILE", help=f"policy YAML (default: ${CONFIG_ENV_VAR} or the packaged one)")
    probe.add_argument("--json", action="store_true", help="JSON on stdout")
    probe.set_defaults(run=_cmd_probe)

    explain = sub.add_parser("explain", help="the chunk geometry the policy picks for a problem")
    _add_problem_args(explain, model_default=None)
    explain.add_argument("--device", metavar="FAMILY", help="plan for a known GPU family (H100, H200, B300, ...)")
    explain.add_argument("--all-gpus", action="store_true", help="a table over the known GPUs even when one is present")
    source = explain.add_mutually_exclusive_group()
    source.add_argument(
        "--config", metavar="FILE", help=f"policy YAML (default: ${CONFIG_ENV_VAR} or the packaged one)"
    )
    source.add_argument(
        "--strategy", metavar="NAME", help=f"use one strategy: {', '.join(BUILTIN_STRATEGIES)} or mod:Class"
    )
    explain.add_argument(
        "--param", action="append", default=[], metavar="KEY=VALUE", help="a --strategy parameter, read as YAML (c=16)"
    )
    explain.add_argument(
        "--master-dtype",
        type=_master_dtype,
        metavar="DTYPE",
        help="the LM head's own dtype under autocast (e.g. float32 master weights with --dtype bfloat16): "
        "the predicted peak holds its low-precision copy and its gradient",
    )
    explain.add_argument(
        "--softcap",
        type=_softcap,
        metavar="C",
        help="the loss call's final-logit softcap (default: --model's, e.g. 30 for Gemma 2 and 4; 0: none)",
    )
    explain.add_argument(
        "--softcap-rounding",
        choices=("fp32", "eager"),
        default="fp32",
        help="the loss's softcap_rounding: fp32 (its default) or eager (what apply_flce passes for Gemma)",
    )
    explain.add_argument("--json", action="store_true", help="JSON on stdout")
    explain.set_defaults(run=_cmd_explain)

    validate = sub.add_parser("validate", help="check a policy YAML and show what it picks on the known GPUs")
    validate.add_argument("file", metavar="FILE")
    _add_problem_args(validate, model_default=_VALIDATE_MODEL)
    validate.add_argument("--json", action="store_true", help="JSON on stdout")
    validate.set_defaults(run=_cmd_validate)

    cache = sub.add_parser("cache", help="the measured strategy's picks kept on disk: list or clear them")
    cache.add_argument("action", choices=("list", "clear"), help="list the picks (and where), or delete them all")
    cache.add_argument("--json", action="store_true", help="JSON on stdout")
    cache.set_defaults(run=_cmd_cache)

    _add_passthrough(sub, "bench", "time and peak memory of FLCE methods on this GPU", _cmd_bench)
    _add_passthrough(
        sub, "tune", "measure chunk sizes on this GPU and write the fastest that fits as a policy YAML", _cmd_tune
    )
    return parser


def _add_passthrough(sub: Any, name: str, help_text: str, run: Any) -> None:
    """A subcommand that parses its own options: every argument after ``name`` is handed over as is
    (prefix_chars that no argument uses keep argparse from reading --out, --help, ... here)."""
    parser = sub.add_parser(name, help=f"{help_text} (see {name} --help)", prefix_chars="\0", add_help=False)
    parser.add_argument(f"{name}_args", nargs=argparse.REMAINDER)
    parser.set_defaults(run=run)


def _add_problem_args(parser: argparse.ArgumentParser, *, model_default: str | None) -> None:
    parser.add_argument(
        "--model", choices=sorted(MODEL_PRESETS), default=model_default, help="fill --vocab/--hidden from a preset"
    )
    parser.add_argument("--vocab", type=_positive_int, metavar="V", help="vocabulary size V")
    parser.add_argument("--hidden", type=_positive_int, metavar="H", help="hidden size H")
    parser.add_argument("--tokens", type=_positive_int, default=DEFAULT_TOKENS, metavar="BT", help="token rows BT")
    parser.add_argument("--dtype", default="bfloat16", help="logits dtype: bfloat16 (default), float16, float32")
    parser.add_argument(
        "--tp-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="vocab-parallel head over N ranks: V is split as a Shard(0) DTensor, the problem is rank 0's shard",
    )


def _problem(args: argparse.Namespace) -> Problem:
    preset = MODEL_PRESETS.get(args.model) if args.model else None
    vocab = args.vocab if args.vocab is not None else (preset.vocab if preset else None)
    hidden = args.hidden if args.hidden is not None else (preset.hidden if preset else None)
    if vocab is None or hidden is None:
        raise _UsageError("give --model, or both --vocab and --hidden")
    shards = _shards(vocab, args.tp_size)
    try:
        return Problem(tokens=args.tokens, hidden=hidden, vocab=shards[0], dtype=args.dtype, tp_size=args.tp_size)
    except ValidationError as err:
        options = {"tokens": "--tokens", "hidden": "--hidden", "vocab": "--vocab", "dtype": "--dtype"}
        raise _UsageError(
            "; ".join(
                f"{options.get(str(e['loc'][0]), e['loc'][0]) if e['loc'] else 'problem'}: {e['msg']}"
                for e in err.errors()
            )
        ) from None


def _shards(vocab: int, tp_size: int) -> list[int]:
    if tp_size > vocab:  # checked first: the split below lists one shard per rank
        raise _UsageError(f"--tp-size {tp_size} is more ranks than V={vocab} has classes; each rank needs a shard")
    shards = vocab_shard_sizes(vocab, tp_size)
    if not all(shards):
        raise _UsageError(f"V={vocab} over --tp-size {tp_size} leaves rank {shards.index(0)} an empty vocab shard")
    return shards


def _policy(args: argparse.Namespace) -> FLCEPolicy:
    if getattr(args, "strategy", None):
        params = _params(args.param)
        try:
            strategy = strategy_from_config({"strategy": args.strategy, **params})
        except StrategyError as err:
            given = str(err.param).split(".")[0]
            raise _UsageError(f"--param {given}: {err}" if given in params else f"--strategy: {err}") from None
        return FLCEPolicy(default=strategy, source=f"--strategy {args.strategy}")
    if getattr(args, "param", None):
        raise _UsageError("--param needs --strategy")
    return FLCEPolicy.from_yaml(args.config) if args.config else FLCEPolicy.default()


def _params(pairs: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise _UsageError(f"--param expects KEY=VALUE, got {pair!r}")
        # Read like a YAML value, by the policy files' reader, so the command line means what a config file
        # would: 16 is an int, 512MiB a string, "{strategy: heuristic_c, c: 16}" a nested strategy (free_memory's
        # cap). What it cannot read (bad syntax, an alias) stays the text, for the strategy to refuse by name.
        try:
            value = load_yaml_text(text, source="--param")
        except ConfigError:
            value = text
        params[key.strip()] = text if value is None or isinstance(value, list) else value
    return params


# --- commands ------------------------------------------------------------------------------------


def _cmd_probe(args: argparse.Namespace) -> int:
    from flce_policy.engine.probe import probe_device_verbose

    device, notes = probe_device_verbose()
    policy = _policy(args)
    rule, strategy = policy.resolve_rule(device)
    if args.json:
        _print_json(
            {
                "device": {**device.model_dump(mode="json"), "description": device.describe()},
                "notes": notes,
                "policy": policy.source,
                "rule": rule,
                "strategy": strategy.config_name(),
                "params": strategy.get_params(),
            }
        )
        return 0
    console = _console()
    console.print(f"Device:   {device.describe()}")
    for note in notes:
        console.print(f"  note:   {note}")
    console.print(f"Policy:   {policy.source}")
    console.print(f"Rule:     {rule}")
    console.print(f"Strategy: {_strategy_text(strategy)}")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    problem = _problem(args)
    policy = _policy(args)
    preset = MODEL_PRESETS.get(args.model) if args.model else None
    softcap = args.softcap if args.softcap is not None else (preset.softcap if preset else None)
    call = {"softcap": softcap or None, "softcap_rounding": args.softcap_rounding}
    if args.device:
        device: DeviceInfo | None = _device(args.device)
        title = ""
    elif args.all_gpus:
        device, title = None, "the decision on each known GPU"
    else:
        from flce_policy.engine.probe import probe_device

        device = probe_device()
        device, title = (device, "") if device.is_gpu else (None, "no GPU here; the decision on each known GPU")
    if device is None:
        known = DeviceInfo.known()
        _print_table(policy, problem, known, as_json=args.json, title=title, master_dtype=args.master_dtype, call=call)
        return 0
    rule, strategy = policy.resolve_rule(device)
    if strategy.dynamic and device.index is None:
        _print_at_call_time(policy, problem, device, as_json=args.json)
    elif args.json:
        ranks = _tp_ranks(policy, problem, device, args) if problem.tp_size > 1 else None
        decision = policy.explain_dict(problem, device, master_dtype=args.master_dtype, **call)
        _print_json({**decision, **({"tp_ranks": ranks} if ranks else {})})
    else:
        _console().print(policy.explain(problem, device, master_dtype=args.master_dtype, **call))
        if problem.tp_size > 1:
            _print_tp_ranks(_tp_ranks(policy, problem, device, args))
    return 0


def _print_at_call_time(policy: FLCEPolicy, problem: Problem, device: DeviceInfo, *, as_json: bool) -> None:
    """A dynamic strategy (free_memory) on a planned GPU: the rule and strategy, and that the size is
    decided at every call (what ``validate``'s table shows), since a planned GPU has no free memory to read."""
    row = _at_call_time(policy, device)
    if as_json:
        _print_json({**row, "problem": problem.model_dump(mode="json"), "policy": policy.source})
        return
    lines = [
        ("Device", device.describe()),
        ("Problem", problem.describe()),
        ("Policy", policy.source),
        ("Rule", row["rule"]),
        ("Strategy", _row_strategy(row)),
        ("Chunk size", f"{row['at_call_time']}; run explain on that GPU to see the size it picks now"),
        ("W filter", _filter_text(row) or "grad_weight_filter=None"),
    ]
    _console().print("\n".join(f"{label + ':':<13}{value}" for label, value in lines))


def _device(family: str) -> DeviceInfo:
    try:
        return DeviceInfo.synthetic(family)
    except ValueError as err:
        raise _UsageError(f"--device: {err}") from None


def _tp_ranks(policy: FLCEPolicy, problem: Problem, device: DeviceInfo, args: argparse.Namespace) -> list[dict]:
    """Each rank's shard and the geometry the policy resolves for it; the loss runs every rank at the
    smallest chunk among them (flce_policy.distributed.vocab_parallel: the row chunks' collectives pair up)."""
    vocab = args.vocab if args.vocab is not None else MODEL_PRESETS[args.model].vocab
    shards = _shards(vocab, problem.tp_size)
    geometries = [policy.resolve(problem.model_copy(update={"vocab": rows}), device) for rows in shards]
    rows = min(g.chunk_size for g in geometries)
    return [
        {"rank": rank, "vocab_shard": shards[rank], "chosen": g.describe(), "chunk_size": g.chunk_size, "runs_at": rows}
        for rank, g in enumerate(geometries)
    ]


def _print_tp_ranks(ranks: list[dict]) -> None:
    console = _console()
    console.print(f"TP ranks:    {len(ranks)}; the group runs chunks of {ranks[0]['runs_at']} rows (the smallest)")
    for r in ranks:
        console.print(f"  rank {r['rank']}: {r['vocab_shard']} classes: {r['chosen']}")


def _cmd_validate(args: argparse.Namespace) -> int:
    try:
        policy = FLCEPolicy.from_yaml(args.file)
    except ConfigError as err:
        if args.json:
            _print_json({"file": args.file, "valid": False, "errors": str(err).splitlines()})
        return _fail(str(err))
    problem = _problem(args)
    devices = DeviceInfo.known()
    unmatched = [
        f"devices[{i}] (match {rule.match}) matches no known GPU family or name; check for a typo"
        for i, rule in enumerate(policy.rules)
        if not any(rule.names(d) for d in [*devices, DeviceInfo.cpu()])
    ]
    packaged = FLCEPolicy.packaged()
    differs = [d.family for d in devices if not policy.same_strategy_as(packaged, d)]
    if differs:
        versus = f"differs from the packaged policy on {len(differs)} of {len(devices)} known GPU families: "
        versus += ", ".join(differs)
    else:
        versus = f"picks as the packaged policy does on all {len(devices)} known GPU families"
    if args.json:
        rows = [
            {**_decision(policy, problem, d), "packaged": _packaged_decision(packaged, problem, d)} for d in devices
        ]
        _print_json(
            {
                "file": args.file,
                "valid": True,
                "notes": unmatched,
                "differs_from_packaged": differs,
                "problem": problem.model_dump(),
                "decisions": rows,
            }
        )
        return 0
    console = _console()
    console.print(f"OK: {args.file} (version {CONFIG_VERSION}, {len(policy.rules)} device rules)")
    for note in unmatched:
        console.print(f"note: {note}")
    title = f"what {args.file} picks on the known GPUs, beside the packaged policy"
    _print_table(policy, problem, devices, as_json=False, title=title, baseline=packaged)
    console.print(f"note: {args.file} {versus}")
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    """``cache list``: each pick file, its GPU, problem, kind of call, pick and when it was measured; ``cache
    clear``: delete them (the next run measures again)."""
    from flce_policy.engine import pick_cache

    folder = pick_cache.cache_dir()
    if args.action == "clear":
        count = pick_cache.clear()
        print(
            json.dumps({"folder": str(folder), "deleted": count}) if args.json else f"deleted {count} picks in {folder}"
        )
        return 0
    rows = []
    for path, cached in pick_cache.entries():
        row: dict[str, Any] = {"file": path.name}
        if cached is None:
            row["error"] = "not a pick this flce-policy wrote (ignored by the loss)"
        else:
            row.update(cached.key.model_dump(), chunk_size=cached.chunk_size, slab_form=cached.slab_form)
            row.update(measured_at=cached.measured_at, times_ms=cached.times_ms)
        rows.append(row)
    if args.json:
        _print_json({"folder": str(folder), "picks": rows})
        return 0
    table = Table(title=f"measured picks in {folder} ({len(rows)})")
    for column in ("GPU", "problem", "kind", "pick", "measured", "versions"):
        table.add_column(column)
    for row in rows:
        if "error" in row:
            table.add_row(row["file"], "", "", row["error"], "", "")
            continue
        versions = f"torch {row['torch']}, triton {row['triton']}, driver {row['driver']}, ours {row['flce_policy']}"
        pick = f"{row['chunk_size']} rows, {row['slab_form']}"
        table.add_row(row["gpu"], row["problem"], row["kind"] or "plain", pick, row["measured_at"], versions)
    _console().print(table)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # Imported here: torch, the kernels and matplotlib load only for bench, so the other commands stay fast.
    from flce_policy.benchmarks import cli as bench_cli

    return bench_cli.main(args.bench_args, prog="flce-policy bench")


def _cmd_tune(args: argparse.Namespace) -> int:
    from flce_policy.cli import tune  # torch and the kernels load only here, as for bench

    return tune.main(args.tune_args, prog="flce-policy tune")


# --- output --------------------------------------------------------------------------------------


def _decision(
    policy: FLCEPolicy,
    problem: Problem,
    device: DeviceInfo,
    *,
    master_dtype: str | None = None,
    call: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """explain_dict (``call``: its softcap keywords), or the error a strategy gave for this device (a budget smaller
    than one row, say).

    A dynamic strategy (free_memory) on a planned GPU has no answer yet: it decides at call time.
    """
    rule, strategy = policy.resolve_rule(device)
    if strategy.dynamic and device.index is None:
        return _at_call_time(policy, device)
    try:
        return policy.explain_dict(problem, device, master_dtype=master_dtype, **(call or {}))
    except StrategyError as err:
        return {
            "device": device.model_dump(mode="json"),
            "rule": rule,
            "strategy": strategy.config_name(),
            "error": str(err),
        }


def _at_call_time(policy: FLCEPolicy, device: DeviceInfo) -> dict[str, Any]:
    rule, strategy = policy.resolve_rule(device)
    return {
        "device": device.model_dump(mode="json"),
        "rule": rule,
        "strategy": strategy.config_name(),
        "params": strategy.get_params(),
        "grad_weight_filter": policy.grad_weight_filter_for(device),
        "grad_weight_filter_rescue": policy.grad_weight_filter_rescue_for(device),
        "at_call_time": "sized at every call from the memory free on the GPU",
    }


def _packaged_decision(packaged: FLCEPolicy, problem: Problem, device: DeviceInfo) -> dict[str, Any]:
    """The packaged policy's rule, strategy and chunk size for ``device``, for comparison."""
    row = _decision(packaged, problem, device)
    return {key: row[key] for key in ("rule", "strategy", "params", "chunk_size") if key in row}


def _print_table(
    policy: FLCEPolicy,
    problem: Problem,
    devices: list[DeviceInfo],
    *,
    as_json: bool,
    title: str,
    baseline: FLCEPolicy | None = None,
    master_dtype: str | None = None,
    call: dict[str, Any] | None = None,
) -> None:
    """The decision on each device: its predicted peak, or with ``baseline`` (validate), a last column
    with the baseline's pick where it differs (the two would not fit a line together). ``call``: explain's
    softcap keywords."""
    rows = [_decision(policy, problem, d, master_dtype=master_dtype, call=call) for d in devices]
    if as_json:
        _print_json({"problem": problem.model_dump(), "policy": policy.source, "decisions": rows})
        return
    master = f"; peak over a {master_dtype} master weight under autocast" if master_dtype else ""
    if call and call["softcap"]:
        master += f"; softcap {call['softcap']:g} ({call['softcap_rounding']} rounding)"
    table = Table(title=f"{title}\n{problem.describe()}; policy {policy.source}{master}")
    columns = ["GPU", "memory", "rule", "strategy", "chunk_size", "chunks", "slab", "form"]
    for column in columns + (["peak"] if baseline is None else ["packaged policy"]):
        table.add_column(column, justify="right" if column in ("chunk_size", "chunks", "slab", "peak") else "left")
    for device, row in zip(devices, rows, strict=True):
        cells = [device.family, format_bytes(device.total_memory_bytes), row["rule"], _row_strategy(row)]
        cells += _pick_cells(row)
        if baseline is None:
            cells.append(format_bytes(row["predicted_peak_bytes"]) if "predicted_peak_bytes" in row else "")
        else:
            same = policy.same_strategy_as(baseline, device)
            cells.append("same" if same else _pick_text(_decision(baseline, problem, device)))
        table.add_row(*cells)
    _console().print(table)


def _row_strategy(row: dict[str, Any]) -> str:
    text = f"{row['strategy']} {_params_text(_given_params(row['strategy'], row.get('params', {})))}".strip()
    filtered = _filter_text(row)
    return f"{text}, {filtered}" if filtered else text


def _given_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """A strategy's parameters less a built-in's left at their defaults, as scikit-learn prints an estimator
    (measured's dozen would fill the cell); --json and the one-device explain keep them all."""
    cls = BUILTIN_STRATEGIES.get(name)
    if cls is None:
        return params
    defaults = {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()}
    return {k: v for k, v in params.items() if defaults.get(k, inspect.Parameter.empty) != v}


def _nested_text(value: Any) -> str:
    """A parameter's value in a table cell: a nested strategy by its name (its parameters would fill the cell; the
    rule column names the YAML entry that holds them, --json prints them)."""
    if isinstance(value, dict) and isinstance(value.get("strategy"), str):
        return value["strategy"]
    return str(value)


def _filter_text(row: dict[str, Any]) -> str:
    """``grad_weight_filter=eps`` (and its rescue) of a decision row; empty without a filter."""
    eps, rescue = row.get("grad_weight_filter"), row.get("grad_weight_filter_rescue")
    if eps is None:
        return ""
    return f"grad_weight_filter={eps:g}" + ("" if rescue is None else f", grad_weight_filter_rescue={rescue}")


def _pick_cells(row: dict[str, Any]) -> list[str]:
    """chunk_size, chunks and slab of a decision row, or what stands in their place."""
    if "error" in row:
        return ["error", "", row["error"], ""]
    if "at_call_time" in row:
        return ["at call time", "", "from free memory", "at call time"]
    # the price list stays in `explain` on one device and in --json; the table says the form and the reason
    if "measured" in row and row["measured"] is None:  # no pick known yet: the limit's geometry stands in for it
        form = f"{row['slab_form']}: the limit's, until the first calls measure"
    else:
        form = f"{row['slab_form']}: {row['slab_form_reason'].split(' (')[0]}"
    return [str(row["chunk_size"]), str(row["num_chunks"]), row["slab"], form]


def _pick_text(row: dict[str, Any]) -> str:
    """A decision in one cell: ``slab_budget max_slab=256MiB: 512 rows``."""
    chunk = _pick_cells(row)[0]
    return f"{_row_strategy(row)}: {chunk} rows" if chunk.isdigit() else f"{_row_strategy(row)}: {chunk}"


def _strategy_text(strategy: Any) -> str:
    return f"{strategy.config_name()} {_params_text(strategy.get_params())}".strip()


def _params_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={_nested_text(v)}" for k, v in params.items())


def _print_json(data: Any) -> None:
    # allow_nan=False: an inf or NaN would print as Infinity/NaN, which is not JSON; the strategies
    # refuse what would give one, so reaching it here is a bug of ours and raises
    print(json.dumps(data, indent=2, default=str, allow_nan=False))


def _console() -> Console:
    # Wide when piped or captured, so tables keep one line per row instead of wrapping at 80 columns;
    # no markup, since device descriptions hold brackets ("[family H100]") rich would eat.
    return Console(width=None if sys.stdout.isatty() else 160, markup=False)
