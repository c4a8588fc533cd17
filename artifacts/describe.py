"""A plain-data summary of an artifact, and its text rendering, for `thinc inspect FILE [--json]`."""

from __future__ import annotations

import os
from math import prod

from thin.ir import printable

from .reader import Artifact, open_artifact
from .spec import PREAMBLE_SIZE, SECTION_NAMES, pack


def describe(artifact: Artifact | str | os.PathLike) -> dict:
    """Plain data: model, format version, key, provenance, sections and sizes, tensors by format."""
    if not isinstance(artifact, Artifact):
        with open_artifact(artifact, writable=False) as opened:
            return describe(opened)
    stored = artifact.header["sections"]
    sections = {}
    for name in SECTION_NAMES:
        entry = {"stored_bytes": len(pack(stored.get(name)))}
        if name == "tokenizer":
            files = stored[name]["files"]
            entry["files"] = {f: {"bytes": v["size"], "stored_bytes": len(v["zstd"])} for f, v in files.items()}
        else:
            entry["present"] = artifact.section(name) not in (None, "", {})
        sections[name] = entry
    by_format: dict[str, dict] = {}
    by_role: dict[str, dict] = {}
    for name in artifact.tensor_names():
        e = artifact.tensor_entry(name)
        for table, key in ((by_format, e.format), (by_role, f"{e.role} {_encoding_label(e)}")):
            slot = table.setdefault(key, {"count": 0, "bytes": 0, "parameters": 0})
            slot["count"] += 1
            slot["bytes"] += e.size
            slot["parameters"] += prod(e.shape)
    for slot in (*by_format.values(), *by_role.values()):
        slot["bits_per_weight"] = round(8 * slot["bytes"] / max(slot["parameters"], 1), 4)
    total_bytes = sum(v["bytes"] for v in by_format.values())
    total_parameters = sum(v["parameters"] for v in by_format.values())
    m = artifact.model
    return {
        "path": str(artifact.path),
        "file_size": artifact.file_size,
        "format_version": list(artifact.format_version),
        "header_bytes": artifact.preamble.header_length,
        "preamble_bytes": PREAMBLE_SIZE,
        "model": {"architecture": m.architecture, "family": m.family, "num_layers": len(m.layers),
                  "hidden_size": m.hidden_size, "vocab_size": m.vocab_size},
        "key": artifact.key,
        "provenance": artifact.provenance,
        "compile_config": artifact.compile_config,
        "sections": sections,
        "tensors": {"count": sum(v["count"] for v in by_format.values()),
                    "bytes": total_bytes, "parameters": total_parameters,
                    "bits_per_weight": round(8 * total_bytes / max(total_parameters, 1), 4),
                    "by_format": dict(sorted(by_format.items())),
                    "by_role": dict(sorted(by_role.items()))},
        "precision_plan": artifact.section("precision_plan"),
        "memory": artifact.section("memory"),
        "certificate": artifact.section("certificate"),
    }


def certificate_summary(cert: dict | None) -> str:
    """One line for a certificate: its verdict and the measurements that matter."""
    if cert is None:
        return "not measured: no certificate (--quant without --max-kld, or compiled before certificates)"
    if cert["status"] == "EXACT":
        return "exact: every tensor as stored in the checkpoint"
    m, gate = cert["measured"], cert["gate"]
    return (f"{cert['status']}: mean KLD {m['mean_kld']:.5f} (gate {gate['max_kld']:g}), top-1 "
            f"{100 * m['top1_agreement']:.1f}%, cosine {m['mean_cosine']:.4f} (min {m['min_cosine']:.3f}), ppl "
            f"{m['perplexity_compiled']:.2f} vs {m['perplexity_source']:.2f}, greedy "
            f"{100 * m['greedy_agreement']:.0f}% on {cert['prompts']['count']}x{cert['prompts']['positions']} "
            "held-out positions")


def ffn_level_summary(cert: dict | None, keep: float, share: float | None = None) -> str:
    """One line for the elastic FFN level `keep` a runtime runs: its certificate, or why there is none
    (with `share`, the share of the FFN bytes an uncertified level reads: whole superblocks round it up)."""
    levels = ((cert or {}).get("ffn_levels") or {}).get("levels", [])
    level = next((lv for lv in levels if abs(lv["keep"] - keep) < 5e-4), None)
    if level is None and keep == 1:  # the whole FFN: the model's own certificate measured it
        return certificate_summary(cert)
    if level is None:
        reads = "" if share is None else (
            "; it reads the whole FFN: the next whole superblock a layer is all of them" if share >= 1 else
            f"; whole 128-channel superblocks make it read {share:.3g} of the FFN bytes")
        return f"FFN level {keep:g}: UNCERTIFIED (not a level the compiler measured){reads}"
    m = level["measured"]
    return (f"FFN level {keep:g}: mean KLD {m['mean_kld']:.5f}, top-1 {100 * m['top1_agreement']:.1f}%, cosine "
            f"{m['mean_cosine']:.4f}, {human_size(level['bytes_per_token'])} of weights per token")


def _level_lines(cert: dict) -> list[str]:
    """The certificate's elastic FFN levels as a table."""
    block = cert.get("ffn_levels")
    if not block:
        return []
    method = ", ".join(f"{k} {v}" for k, v in sorted(block["method"].items()))
    rows = [("keep", "channels per layer", "FFN bytes", "bytes/token", "mean KLD", "top-1", "cosine")]
    for lv in block["levels"]:
        m = lv["measured"]
        rows.append((f"{lv['keep']:g}", ",".join(map(str, lv["channels"])), human_size(lv["ffn_bytes"]),
                     human_size(lv["bytes_per_token"]), f"{m['mean_kld']:.5f}", f"{100 * m['top1_agreement']:.1f}%",
                     f"{m['mean_cosine']:.4f}"))
    return ["", f"elastic FFN levels ({method})", *_table(rows, (2, 3, 4, 5, 6))]


def _encoding_label(e) -> str:
    """`int4(asymmetric=0,group_size=128)`: a format with its parameters, as one word."""
    return e.format + (f"({','.join(f'{k}={v}' for k, v in e.params)})" if e.params else "")


def _flat(config: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Nested option mappings as sorted dotted (key, value) pairs: quantize.format=int4."""
    out = []
    for key, value in sorted(config.items(), key=lambda kv: str(kv[0])):
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def human_size(n: int) -> str:
    """Bytes as text in binary units: 512 B, 1.5 KiB, 11.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[tuple[str, ...]], right: tuple[int, ...]) -> list[str]:
    """Rows as aligned text; columns in `right` (numbers) align right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


def render_description(d: dict) -> str:
    """Human-readable text of `describe()` output."""
    m = d["model"]
    lines = [
        f"{d['path']}  ({human_size(d['file_size'])}, .thin format {d['format_version'][0]}.{d['format_version'][1]})",
        (f"model     {m['architecture']} ({m['family']}), {m['num_layers']} layers, "
         f"hidden {m['hidden_size']}, vocab {m['vocab_size']}"),
        f"key       {d['key'] or '(none)'}",
        f"thin      {d['provenance'].get('thin_version', '?')}",
        f"source    config.json sha256 {d['provenance'].get('source_config_sha256', '?')}",
        "compile   " + (" ".join(f"{k}={v}" for k, v in _flat(d["compile_config"] or {})) or "-"),
        "",
        "tensors",
    ]
    t = d["tensors"]
    rows = [("format", "count", "bytes", "bits/weight")]
    rows += [(f, str(v["count"]), human_size(v["bytes"]), f"{v['bits_per_weight']:.3f}")
             for f, v in t["by_format"].items()]
    rows.append(("total", str(t["count"]), human_size(t["bytes"]), f"{t['bits_per_weight']:.3f}"))
    lines += _table(rows, (1, 2, 3))
    lines += ["", "tensors by role"]
    rows = [("role", "encoding", "count", "bytes", "bits/weight")]
    for key, v in t["by_role"].items():
        role, encoding = key.split(" ", 1)
        rows.append((role, encoding, str(v["count"]), human_size(v["bytes"]), f"{v['bits_per_weight']:.3f}"))
    lines += _table(rows, (2, 3, 4))
    lines += ["", "sections"]
    rows = [("section", "stored", "contents")]
    for name, s in d["sections"].items():
        if "files" in s:
            what = ", ".join(f"{f} ({human_size(v['bytes'])})" for f, v in s["files"].items()) or "none"
        else:
            what = "yes" if s["present"] else "-"
        rows.append((name, human_size(s["stored_bytes"]), what))
    lines += _table(rows, (1,))
    lines += ["", "certificate", "  " + certificate_summary(d.get("certificate"))]
    cert = d.get("certificate") or {}
    if cert.get("status") in ("PASSED", "FAILED"):
        m = cert["measured"]
        rows = [("measure", "value")]
        rows += [(k.replace("_", " "), f"{v:.6g}" if isinstance(v, float) else str(v)) for k, v in sorted(m.items())]
        rows.append(("gate", f"mean KLD <= {cert['gate']['max_kld']:g}" + (" (default)" if cert["gate"].get(
            "default") else "")))
        rows.append(("prompts", f"{cert['prompts']['count']} x {cert['prompts']['positions']} positions, "
                                f"sha256 {cert['prompts']['sha256'][:16]}"))
        if cert.get("predicted_kld") is not None:
            rows.append(("predicted KLD", f"{cert['predicted_kld']:.6g}"))
        rows.append(("promotion rounds", str(len(cert.get("rounds", [])))))
        lines += _table(rows, ())
    lines += _level_lines(cert)
    memory = d.get("memory")
    if memory is not None:
        lines += ["", f"memory ledger (--ctx {memory['ctx']})"]
        rows = [("item", "bytes", "")]
        rows += [(k.replace("_", " "), str(v), human_size(v)) for k, v in memory["lines"].items()]
        rows.append(("total", str(memory["total"]), human_size(memory["total"])))
        if memory.get("budget"):
            rows.append(("budget (--vram)", str(memory["budget"]), human_size(memory["budget"])))
        lines += _table(rows, (1, 2))
        lines.append(f"  {memory.get('overhead_source', '?')}")
        if memory.get("residency"):
            lines.append(f"  residency: {residency_summary(memory['residency'])}")
    plan = (d.get("precision_plan") or {}).get("plan")
    if plan is not None:
        experts = plan.get("experts")
        experts = f" (routed experts {experts['bits_per_weight']:.3f})" if isinstance(experts, dict) and \
            isinstance(experts.get("bits_per_weight"), (int, float)) else ""
        lines += ["", f"precision plan: {plan['bits_per_weight']:.3f} bits per weight{experts}, predicted KLD "
                      f"{plan['predicted_kld']:.5f}, {len(plan['choices'])} tensors planned ({plan['method']})"]
    lines += ["", f"header    {human_size(d['header_bytes'])}"]
    # Every field but the sizes comes from the file: each line is made printable before the join.
    return "\n".join(map(printable, lines))


def residency_summary(residency: dict) -> str:
    """One line for a residency plan (memory.residency: thinc compile --stream-experts)."""
    host = len(residency["host"])
    if not host:
        return f"all {residency['resident_experts']} routed experts resident on the GPU"
    return (f"{residency['resident_experts']} routed experts resident, {host} in host memory "
            f"({human_size(residency['host_bytes'])}), streamed through {residency['slots']} GPU slots of "
            f"{human_size(residency['slot_bytes'])} ({printable(residency['policy'])}; ranked by "
            f"{printable(residency['ranked_by'])})")
