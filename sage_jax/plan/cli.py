"""The planner's command line: `python -m sage_jax.plan` (__main__.py) parses its flags here, sets the platform up
before JAX is imported (prepare), and runs memory.run; `--chip cpu` runs phase_check's measured check instead."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from typing import Sequence

from sage_jax.plan import memory, roofline

# Simulated XLA:CPU devices: each holds its own buffers and thread pool (64 devices plan the 7B configs in a few
# GB); far more exhausted this machine's memory and the process was killed without a word (100,000 were asked for).
MAX_CPU_DEVICES = 1024
# Dimensions of a TPU slice's topology: libtpu aborts the whole process (no Python error) on a shape of the wrong rank.
SLICE_DIMS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}


def parse_flags(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our flags and the --config.key=value overrides; imports nothing heavy (JAX must not be loaded yet)."""
    overrides = [a for a in argv if a.startswith("--config.")]
    parser = argparse.ArgumentParser(prog="python -m sage_jax.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="configs/NAME.py[:arg]")
    parser.add_argument("--devices", type=int, default=None, help="number of devices (chips); with --compiler tpu "
                        "it picks the slice's usual shape when --topology is not given")
    per_device = parser.add_mutually_exclusive_group()
    per_device.add_argument("--memory-gb", type=float, help="memory per device in GB (1e9 bytes); default: the chip's")
    per_device.add_argument("--chip", choices=sorted(memory.CHIPS_GB), help="memory per device from a chip ("
                            + ", ".join(f"{k} {v:.1f} GB" for k, v in memory.CHIPS_GB.items())
                            + "); with --compiler tpu also "
                        "the TPU generation to compile for (default v5p)")
    parser.add_argument("--compiler", choices=("cpu", "tpu"), default="tpu" if roofline.available() else "cpu",
                        help="tpu: libtpu's XLA:TPU for an abstract slice, with a predicted run time (the default "
                             "when libtpu is installed); cpu: XLA:CPU on --devices simulated devices")
    parser.add_argument("--topology", default="", help="TPU slice shape, e.g. 2x4x4 (v5p-64) or 4x4 (v5e-16)")
    parser.add_argument("--layers", type=int, default=0, help="compile N and N+1 layers, extrapolate to full depth")
    parser.add_argument("--no-compile", action="store_true", help="analytic bytes only (no activations); with "
                        "--compiler tpu the prediction is still made unless --no-predict")
    parser.add_argument("--no-predict", action="store_true", help="with --compiler tpu: memory only, no roofline")
    parser.add_argument("--cache", default=None, help="compile cache directory (sage_jax.plan.cache; default "
                        "$SAGE_JAX_PLAN_CACHE or ~/.cache/sage_jax/plan; 'off': compile everything)")
    parser.add_argument("--programs", default=",".join(memory.PROGRAMS),
                        help=f"memory programs to compile, comma-separated ({', '.join(memory.PROGRAMS)}); a subset "
                        "skips the prediction (e.g. sampler: its breakdown only)")
    parser.add_argument("--decode-rows", default="", help="with --compiler tpu: the decode shapes judged (rows decoding "
                        "at once, comma-separated; default the config's slots): one `decode:` line each")
    parser.add_argument("--json", default="", help="write the report as one JSON line to this file ('-': stdout)")
    args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
    config_file = args.config.partition(":")[0]
    if not os.path.isfile(config_file):  # before the flag checks below, which would name another flag
        parser.error(f"--config {args.config}: config file {config_file!r} not found (expected e.g. "
                     "configs/cpu_demo.py)")
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices {args.devices}: must be >= 1 (the number of devices to plan for)")
    args.devices = args.devices or 0  # 0: not given
    if args.topology and not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){1,2}", args.topology):
        parser.error(f"--topology {args.topology!r} is not a slice shape: write AxB or AxBxC, e.g. 2x4x4 (v5p-64)")
    if args.memory_gb is not None and not args.memory_gb > 0:
        parser.error(f"--memory-gb {args.memory_gb:g}: must be > 0 (memory per device in GB)")
    args.programs = tuple(p for p in args.programs.split(",") if p)
    if not args.programs or set(args.programs) - set(memory.PROGRAMS):
        parser.error(f"--programs {','.join(args.programs)!r}: name some of {', '.join(memory.PROGRAMS)}")
    if not re.fullmatch(r"(\d+(,\d+)*)?", args.decode_rows) or "0" in args.decode_rows.split(","):
        parser.error(f"--decode-rows {args.decode_rows!r}: write rows as positive integers, e.g. 64,256")
    args.decode_rows = tuple(int(r) for r in args.decode_rows.split(",") if r)
    if args.compiler == "cpu" and args.devices > MAX_CPU_DEVICES:
        parser.error(f"--devices {args.devices}: XLA:CPU cannot simulate more than {MAX_CPU_DEVICES} devices in "
                     "this machine's memory; plan a pod with --compiler tpu (libtpu), or check a smaller mesh")
    if args.compiler == "tpu" and args.topology and args.chip in SLICE_DIMS and \
            args.topology.count("x") + 1 != SLICE_DIMS[args.chip]:
        shape = "AxBxC (e.g. 2x4x4)" if SLICE_DIMS[args.chip] == 3 else "AxB (e.g. 4x4)"
        parser.error(f"--chip {args.chip} --topology {args.topology}: a {args.chip} slice is shaped {shape}")
    if args.compiler == "cpu" and args.devices < 1:
        parser.error("--compiler cpu needs --devices N >= 1 (the number of simulated devices)")
    if args.compiler == "tpu":
        args.chip = args.chip or "v5p"
        if args.chip not in roofline.CHIPS:
            parser.error(f"--chip {args.chip} is not a TPU: pass --compiler cpu, or a TPU chip "
                         f"({', '.join(roofline.CHIPS)})")
        if not args.topology and args.devices < 1:
            parser.error("--compiler tpu needs --topology AxBxC (or --devices N for the usual N-chip slice)")
    return args, overrides


def prepare(args: argparse.Namespace) -> None:
    """What must happen before JAX is imported."""
    if args.compiler == "cpu":
        memory.simulate_devices(args.devices)
    else:
        roofline.prepare_environment()


def cpu_check(argv: Sequence[str]) -> bool:
    """--chip cpu: the phase model against this machine's measured steps (plan_phases), not a config's plan."""
    return "--chip=cpu" in argv or any(a == "--chip" and b == "cpu" for a, b in zip(argv, argv[1:]))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():
        # A plan has no state to save, and a Python handler cannot run while XLA compiles (minutes): SIGTERM ends the
        # process at once. The programs compiled so far are in the plan cache, and a rerun takes them from there.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cpu_check(argv):
        from sage_jax.plan import phase_check as plan_phases
        return plan_phases.cpu_main(argv)
    args, overrides = parse_flags(argv)
    prepare(args)
    from sage_jax.plan import cache as plan_cache
    from sage_jax.run import config as config_lib
    config = config_lib.validate(config_lib.load(args.config, overrides))  # the checks `train` runs
    memory_gb = args.memory_gb or memory.CHIPS_GB[args.chip or "v5p"]
    report = memory.run(config, args.devices, memory_gb, layers=args.layers, do_compile=not args.no_compile,
                 config_name=args.config, compiler=args.compiler, chip=args.chip or "v5p", topology=args.topology,
                 predict=not args.no_predict, cache_dir=args.cache or plan_cache.default_dir(), names=args.programs,
                 decode_rows=args.decode_rows)
    if args.compiler == "tpu" and not args.no_predict and report["prediction"]:  # the off-policy placements (phase_model: analytic)
        from sage_jax.models import build
        from sage_jax.plan import phase_check as plan_phases
        report["placements"] = plan_phases.placements_for(config, build.resolve_model(config)[0], args.chip or "v5p",
                                                          report["chips"])
    print(memory.format_report(report))
    if "placements" in report:
        print(plan_phases.format_placements(report["placements"], args.chip or "v5p", report["chips"]))
    if args.json:
        line = json.dumps(report)
        if args.json == "-":
            print(line)
        else:
            with open(args.json, "w") as f:
                f.write(line + "\n")
    return 0 if report["fits"] else 1

