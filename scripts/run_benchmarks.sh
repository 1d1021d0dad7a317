#!/usr/bin/env bash
# Run every benchmark with its defaults and collect the Markdown into docs/benchmarks.md.
#
#   scripts/run_benchmarks.sh                 # from anywhere; uses the repo's .venv
#   PYTHON=/path/to/python OUT=/tmp/b DOC=/tmp/benchmarks.md scripts/run_benchmarks.sh
#   REPORT_ONLY=1 scripts/run_benchmarks.sh   # rebuild the doc from the results already in $OUT
#   ONLY="bench_speed" ARGS_bench_speed="--sizes 0.125,0.25 --no-stock" scripts/run_benchmarks.sh
#
# ONLY (space-separated names) runs a subset; the doc still covers every benchmark, from the
# results in $OUT. ARGS_<name> adds arguments to that benchmark's command line.
# bench_speed (1 and 4 GiB checkpoints, cold cache; needs root to drop the page cache, else
# it says "warm cache") takes much longer than the others. bench_export_vs_accelerate (64, 256
# and 1024 MiB Accelerate FSDP checkpoints, `accelerate merge-weights` beside `reshard export`)
# takes about 5-10 minutes on 2 CPUs.
#
# Each benchmark (scripts/<name>.py) writes <name>.md and <name>.json into $OUT (default
# bench-results/). This script then writes $DOC (default docs/benchmarks.md): a header
# naming the machine, then per benchmark its table and a paragraph interpreting the
# figures against the target, computed from its JSON (so it is never stale).
# Exit status: that of the first benchmark that failed (0 when all succeeded); the doc is
# written either way with whatever tables exist.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="${OUT:-$ROOT/bench-results}"
DOC="${DOC:-$ROOT/docs/benchmarks.md}"
BENCHES=(bench_inspect bench_convert_memory bench_speed bench_export_vs_accelerate)
read -r -a RUN <<< "${ONLY:-${BENCHES[*]}}"

if [ ! -x "$PYTHON" ]; then
  echo "error: no interpreter at $PYTHON (create the venv: python3 -m venv .venv && .venv/bin/pip install -e .)" >&2
  exit 2
fi
mkdir -p "$OUT" "$(dirname "$DOC")"
cd "$ROOT"

status=0
for b in "${RUN[@]}"; do
  [ -n "${REPORT_ONLY:-}" ] && break   # REPORT_ONLY=1: only rebuild $DOC from the results already in $OUT
  if [ ! -f "scripts/$b.py" ]; then
    echo "error: no benchmark scripts/$b.py" >&2
    [ "$status" -eq 0 ] && status=2
    continue
  fi
  extra_var="ARGS_$b"
  read -r -a extra <<< "${!extra_var:-}"
  echo "== $b ${extra[*]}" >&2
  rm -f "$OUT/$b.md" "$OUT/$b.json"
  "$PYTHON" "scripts/$b.py" --out "$OUT" "${extra[@]}"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "warning: $b exited $rc" >&2
    [ "$status" -eq 0 ] && status=$rc
  fi
done

mem_gib="$(awk '/^MemTotal:/ {printf "%.1f", $2 / 1048576}' /proc/meminfo 2>/dev/null || echo '?')"
cpu_model="$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null || true)"
versions="$("$PYTHON" -c 'import platform, torch, reshard; print("Python", platform.python_version() + ", torch", torch.__version__ + ", reshard", getattr(reshard, "__version__", "?"))' 2>/dev/null || echo 'versions unavailable')"
commit="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
dirty="$(git -C "$ROOT" status --porcelain 2>/dev/null | head -1)"

interpret() {  # $1 = benchmark name; prints one paragraph from $OUT/$1.json
  "$PYTHON" - "$OUT/$1.json" "$1" <<'PY'
import json, sys
path, name = sys.argv[1], sys.argv[2]
try:
    r = json.load(open(path))
except (OSError, ValueError):
    print(f"No result file ({path}); the benchmark did not finish.")
    sys.exit()
if name == "bench_inspect":
    small, large = r["cases"]
    d = r["difference_s"]
    if d is None:
        print("Inspect did not run to completion on both checkpoints, so the target cannot be judged; see Problems above.")
        sys.exit()
    extra = large["entries"] - small["entries"]
    print(f"**Interpretation.** Target: inspecting {large['entries']:,} entries costs less than "
          f"{r['target_s']:g} s more than {small['entries']:,}. Measured: {d:+.3f} s "
          f"({'met' if r['meets_target'] else 'MISSED'}), i.e. about {1000 * d / extra * 1000:.2f} ms per 1,000 extra "
          f"entries. The small case's {small['timing']['median_s']:.2f} s is almost all interpreter start-up and the "
          f"torch import, paid once whatever the checkpoint; inspect reads the `.metadata`, stats the data files "
          f"and reads only the few small items it needs.")
elif name == "bench_convert_memory":
    cs = r["cases"]
    a, b = cs[0], cs[-1]
    d = r["convert_rss_difference_mib"]
    if d is None:
        print("A convert or verify run failed, so the memory target cannot be judged; see Problems above.")
        sys.exit()
    base = (r.get("baseline") or {}).get("peak_rss_mib")
    ratio = b["facts"]["bytes_on_disk"] / a["facts"]["bytes_on_disk"]
    thr = lambda c: c["facts"]["bytes_on_disk"] / (1 << 20) / c["convert"]["wall_s"]
    lt = a["facts"]["largest_tensor_bytes"] / (1 << 20)
    lc = a["facts"]["largest_chunk_bytes"] / (1 << 20)
    runs = lambda c: ", ".join(f"{x:,.0f}" for x in c["convert"].get("runs_peak_rss_mib", []))
    s = (f"**Interpretation.** Target: the peak RSS of converting the {b['size_gib']:g} GiB checkpoint exceeds that of the "
         f"{a['size_gib']:g} GiB one (same {lt:,.0f} MiB largest tensor) by less than {r['target_mib']:g} MiB. Measured: "
         f"{a['convert']['peak_rss_mib']:,.0f} MiB vs {b['convert']['peak_rss_mib']:,.0f} MiB (medians; runs {runs(a)} and "
         f"{runs(b)}), a difference of {d:+.1f} MiB for a {ratio:.1f}x larger checkpoint: "
         f"**{'PASS' if r['meets_target'] else 'FAIL'}**. ")
    if base:
        own = sorted(c["convert"]["peak_rss_mib"] - base for c in (a, b))
        s += (f"A process that only imports torch and reshard already peaks at {base:,.0f} MiB, so convert's own working "
              f"set is about {own[0]:,.0f}-{own[1]:,.0f} MiB: "
              f"a few {lc:,.0f} MiB source chunks and the target chunks assembled from them, not the checkpoint. ")
    spread = max(max(c["convert"]["runs_peak_rss_mib"]) - min(c["convert"]["runs_peak_rss_mib"]) for c in cs)
    s += (f"Identical runs spread by up to {spread:,.0f} MiB, "
          + ("so the difference is within run-to-run noise. " if abs(d) <= spread else
             "so the difference is larger than run-to-run noise. "))
    samples = b["convert"].get("run_samples", [[]])[-1]
    if len(samples) > 20:
        import statistics as st
        t_end = samples[-1][0]
        # the conversion proper: from when RSS first reaches the import baseline (torch loaded) to the end
        t0 = next((t for t, m in samples if base and m >= 0.9 * base), samples[0][0])
        span = t_end - t0
        q1 = [m for t, m in samples if t0 <= t < t0 + span * 0.25]
        q4 = [m for t, m in samples if t >= t0 + span * 0.75]
        if q1 and q4 and span > 2:
            s += (f"After the imports ({t0:.1f} s), the sampled RSS of the {b['size_gib']:g} GiB conversion is "
                  f"{st.median(q1):,.0f} MiB (median) in the first quarter of the remaining {span:.0f} s and "
                  f"{st.median(q4):,.0f} MiB in the last: "
                  + ("a plateau, not a climb with the bytes processed. " if st.median(q4) - st.median(q1) < 16 else
                     "it climbs as it goes. "))
    s += (f"Page cache "
          f"(the checkpoint's bytes read and written) is not RSS and is not counted. Throughput: "
          f"{thr(a):,.0f} and {thr(b):,.0f} MiB/s for convert (which also re-reads both checkpoints to verify the "
          f"output before committing it), against {a['cp']['wall_s']:.2f} and {b['cp']['wall_s']:.2f} s for a plain "
          f"`cp -r` of the source (mostly from page cache). Wall times vary a lot with the machine's load "
          f"(load average {r['machine'].get('loadavg', ['?'])[0]:.1f} on {r['machine']['nproc']} CPUs at the end of this run; "
          f"convert runs of the {b['size_gib']:g} GiB checkpoint took "
          f"{min(b['convert']['runs_wall_s']):.0f}-{max(b['convert']['runs_wall_s']):.0f} s); "
          f"peak RSS does not.")
    print(s)
elif name == "bench_speed":
    sm, M, T = r["summary"], r["summary"]["marginal"], r["summary"]["targets"]
    a, b = r["cases"][0], r["cases"][-1]
    sg, lg = f"{a['size_gib']:g} GiB", f"{b['size_gib']:g} GiB"
    mg = lambda c, f="marginal_s_per_gib": (M.get(c) or {}).get(f)
    names = {"convert_le_1.5x_cp": "convert <= 1.5x `cp -r`", "convert_10x_below_stock": "convert >= 10x below stock",
             "convert_rss_flat": "convert peak RSS flat", "stock_rss_grows": "stock peak RSS grows",
             "verify_le_1.5x_cp": "verify <= 1.5x `cp -r`", "torchrun_byte_identical": "torchrun byte-identical"}
    met = [names.get(k, k) for k, v in T.items() if v]
    missed = [names.get(k, k) for k, v in T.items() if not v]
    ins = r.get("inspect") or {}
    if ins.get("meets_target") is not None:
        (met if ins["meets_target"] else missed).append("inspect 10,000 entries < 1 s more than 10")
    s = (f"**Interpretation.** Marginal costs between the {sg} and {lg} checkpoints "
         f"({sm['delta_gib']:.2f} GiB apart{'' if r['cold_cache'] else ', warm cache'}). "
         f"Targets met: {', '.join(met) or 'none'}; missed: {', '.join(missed) or 'none'}"
         + (f"; not judged: {', '.join(names.get(k, k) for k in sm.get('unjudged', {}))}" if sm.get("unjudged") else "")
         + ". ")
    if mg("cp") and mg("convert") is not None:
        s += (f"Copying costs {mg('cp'):.2f} s/GiB; `reshard convert --to {r['to']}` {mg('convert'):.2f} s/GiB "
              f"({mg('convert', 'ratio_to_cp') or float('nan'):.1f}x) of which {mg('convert', 'marginal_cpu_s_per_gib'):.2f} "
              f"s/GiB is CPU time (user + sys); "
              f"`verify` {mg('verify') if mg('verify') is not None else float('nan'):.2f} s/GiB. ")
    if mg("stock", "rss_diff_mib") is not None and mg("convert", "rss_diff_mib") is not None:
        s += (f"The stock path's peak RSS goes from {mg('stock', 'small_rss_mib'):,.0f} to {mg('stock', 'large_rss_mib'):,.0f} "
              f"MiB (it holds the whole checkpoint), convert's from {mg('convert', 'small_rss_mib'):,.0f} to "
              f"{mg('convert', 'large_rss_mib'):,.0f} MiB. ")
    if mg("convert_tp") is not None:
        s += (f"The TP change (`--to {r['tp_to']}`, every tensor re-cut along dim {r['tp_dim']}) costs "
              f"{mg('convert_tp'):.2f} s/GiB (peak RSS {mg('convert_tp', 'small_rss_mib'):,.0f} -> "
              f"{mg('convert_tp', 'large_rss_mib'):,.0f} MiB). ")
    elif r.get("tp_not_measured"):
        s += f"The TP change was not measured: {r['tp_not_measured']}. "
    for key, what in (("convert_torchrun", "torchrun"), ("convert_workers", "`--workers`")):
        d = (sm.get("distributed") or {}).get(key)
        if not d:
            continue
        if d.get("large_speedup") is None:
            s += f"The {what} conversion did not complete (see Problems). "
            continue
        ident = {True: "byte-identical to", False: "NOT byte-identical to", None: "not compared with"}[d["byte_identical"]]
        s += (f"With {what} ({r['dist_workers']} processes) the {lg} conversion is {d['large_speedup']:.2f}x as fast "
              f"as one process (marginal {d['marginal_speedup'] or float('nan'):.2f}x) and its output is {ident} "
              f"the single-process output. ")
    la = (r.get("loadavg_start"), r["machine"].get("loadavg", [None])[0])
    if None not in la and max(la) > r["machine"]["nproc"]:
        s += (f"The load average ({la[0]:.1f} at the start, {la[1]:.1f} at the end, on {r['machine']['nproc']} CPUs) "
              "says other work competed for the CPUs: the timings are noisy.")
    print(s)
elif name == "bench_export_vs_accelerate":
    rows = r["summary"]["rows"]
    if not rows:
        print("No size had both `accelerate merge-weights` and `reshard export` succeed, so nothing is compared; "
              "see the table.")
        sys.exit()
    fmt = lambda xs: ", ".join(f"{x:.2f}x" for x in xs)
    a, z = rows[0], rows[-1]
    s = (f"**Interpretation.** On the same Accelerate checkpoints ({', '.join(f'{x:g}' for x in r['sizes_mib'])} MiB "
         f"of weights), `reshard export` took {fmt([x['time_ratio'] for x in rows])} the wall time of "
         f"`accelerate merge-weights` and {fmt([x['rss_ratio'] for x in rows])} its peak RSS; the outputs are "
         + ("bitwise identical at every size. " if r["summary"]["all_identical"] else "NOT identical at every size. "))
    hf = [x for x in rows if "hf_time_ratio" in x]
    if hf:
        s += (f"`--format hf` (names mapped, wq/wk rows reordered) took {fmt([x['hf_time_ratio'] for x in hf])} "
              f"accelerate's time and {fmt([x['hf_rss_ratio'] for x in hf])} its peak RSS, its tensors "
              + ("equal to accelerate's mapped independently by the benchmark. " if all(x["hf_identical"] for x in hf)
                 else "NOT all equal to accelerate's mapped by the benchmark. "))
    elif any("hf_error" in x for x in rows):
        s += f"`--format hf` failed: {next(x['hf_error'] for x in rows if 'hf_error' in x)}. "
    if len(rows) > 1:
        s += (f"From {a['size_mib']:g} to {z['size_mib']:g} MiB accelerate's peak goes from {a['accelerate_rss_mib']:,.0f} "
              f"to {z['accelerate_rss_mib']:,.0f} MiB ({z['accelerate_rss_mib'] - a['accelerate_rss_mib']:+,.0f}: it loads "
              f"the whole state dict before writing), reshard's from {a['reshard_rss_mib']:,.0f} to "
              f"{z['reshard_rss_mib']:,.0f} MiB ({z['reshard_rss_mib'] - a['reshard_rss_mib']:+,.0f}: one tensor at a "
              "time). ")
    b = r.get("baselines") or {}
    if all((b.get(k) or {}).get("exit_code") == 0 for k in ("accelerate", "reshard")):
        s += (f"Start-up is part of every time: `accelerate merge-weights --help` alone took {b['accelerate']['wall_s']:.1f} s, "
              f"importing torch and reshard's export {b['reshard']['wall_s']:.1f} s. ")
    full = next((c["full_training"] for c in r["cases"] if c.get("full_training")), None)
    if full:
        parts = []
        for inp in dict.fromkeys(x["input"] for x in full):
            got = {" ".join(x["argv"]): x for x in full if x["input"] == inp}
            def say(k, ok):
                if k not in got:
                    return None
                x = got[k]
                if x["exit_code"] != 0:
                    return f"exit {x['exit_code']}"
                v = x.get("vs_accelerate_model")
                if v:  # what the safetensors output holds: weights (equal to accelerate's merge?) and/or moments
                    ok = " and ".join(([("weights equal to accelerate's" if v["model_tensors_equal"] else "weights NOT equal")]
                                       if v["compared"] else []) + (["moments"] if v["n_only_in_b"] else []))
                return ok
            bits = [say("accelerate merge-weights", "merged"),
                    say("accelerate merge-weights --unsafe_serialization", "a pickle of the state dict"),
                    say("reshard export", "exported"), say("reshard export --only model+optim", "exported")]
            names = ["accelerate", "accelerate --unsafe_serialization", "reshard", "reshard --only model+optim"]
            parts.append(f"{inp}: " + ", ".join(f"{n} {v}" for n, v in zip(names, bits) if v))
        s += "Full training checkpoints (see the second table): " + "; ".join(parts) + "."
    print(s)
PY
}

{
  echo "# Benchmarks"
  echo
  echo "Generated by \`scripts/run_benchmarks.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC') at commit \`$commit\`${dirty:+ (with uncommitted changes)}."
  echo
  echo "Machine: $(nproc) CPUs${cpu_model:+ ($cpu_model)}, $mem_gib GiB RAM, $(uname -sr), $versions, CPU only."
  echo "Times are wall-clock and include interpreter start-up and imports; each table gives the load average when it ran."
  echo "Re-run with \`scripts/run_benchmarks.sh\` (raw results: \`bench-results/*.json\`)."
  echo
  for b in "${BENCHES[@]}"; do
    if [ -f "$OUT/$b.md" ]; then
      sed -e 's/^# /## /' "$OUT/$b.md"   # the benchmark's H1 becomes an H2 under the page title
    else
      printf '## %s\n\nDid not produce a table (see its output).\n' "$b"
    fi
    echo
    interpret "$b"
    echo
  done
} > "$DOC.tmp" && mv "$DOC.tmp" "$DOC"
echo "wrote $DOC" >&2
exit "$status"
