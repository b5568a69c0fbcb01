"""What is inside a GGUF: architecture, parameter counts, experts and their byte ranges, types, provenance.

Example:
    >>> print(format_inspect(inspect_gguf(Path("model.gguf"))))
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.gguf import schema
from mfgguf.gguf.header import check_not_v01
from mfgguf.gguf.router_rows import router_rows
from mfgguf.gguf.slots import routed_slots


def _value(f):
    if len(f.types) > 1 or (f.types and f.types[0].name == "ARRAY"):
        items = [f.parts[i] for i in f.data]
        return [bytes(x).decode("utf-8", "replace") if x.dtype == np.uint8 else x.tolist()[0] for x in items]
    v = f.parts[f.data[0]]
    return bytes(v).decode("utf-8", "replace") if v.dtype == np.uint8 else v.tolist()[0]


def inspect_gguf(path: Path) -> dict:
    """Read a GGUF's header: architecture, hyper-parameters, tensors, experts' byte ranges, provenance.

    Example:
        mfgguf inspect model.gguf
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise MfggufError(f"{path} does not exist; give the path of a .gguf file")
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError/struct errors on a non-GGUF file
        raise MfggufError(f"{path} is not a readable GGUF file ({e})") from None
    kv, arrays = {}, {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        check_not_v01(path, k)
        is_array = f.types and f.types[0] == gguf.GGUFValueType.ARRAY
        if is_array and k.startswith("tokenizer."):
            arrays[k] = len(f.data)  # tokens/merges: only their count
        else:
            kv[k] = _value(f)
    arch = kv.get("general.architecture", "?")
    quant = kv.get("mfgguf.quant")
    n_exp = int(kv.get(f"{arch}.expert_count", 0) or 0)
    k_used = int(kv.get(f"{arch}.expert_used_count", 0) or 0)
    tensors, total, stacked = [], 0, 0
    for t in r.tensors:
        shape_np = tuple(int(d) for d in t.shape[::-1])
        tname = t.tensor_type.name.lower()
        why = None
        if quant in schema.QTYPES:
            want, why = schema.tensor_type(t.name, shape_np, quant)
            why = why if want == tname else f"type {tname} (rule says {want})"
        n = int(t.n_elements)
        total += n
        is_exps = t.name.endswith("_exps.weight")
        stacked += n if is_exps else 0
        tensors.append({"name": t.name, "type": tname, "shape": shape_np, "elements": n, "bytes": int(t.n_bytes),
                        "offset": int(t.data_offset), "note": why, "stacked": is_exps})
    active = total - (stacked - stacked * k_used // n_exp if n_exp else 0)
    slots = routed_slots(lambda k, default=None: kv.get(k, default))
    experts = []
    for p in range(n_exp):
        ranges = []
        for t in tensors:
            if t["stacked"]:
                eb = t["bytes"] // n_exp
                ranges.append((t["name"], t["offset"] + p * eb, t["offset"] + (p + 1) * eb))
        experts.append({**slots[p], "bytes": sum(b - a for _, a, b in ranges), "ranges": ranges})
    return {
        "path": str(path), "bytes": path.stat().st_size, "architecture": arch, "n_experts": n_exp, "top_k": k_used,
        "params_total": total, "params_active": active, "n_tensors": len(tensors),
        "hparams": {k: v for k, v in kv.items() if k.startswith(f"{arch}.")},
        "tokenizer": {**{k: v for k, v in kv.items() if k.startswith("tokenizer.")}, **{k: f"{n} items" for k, n in arrays.items()}},
        "provenance": {k: v for k, v in kv.items() if k.startswith("mfgguf.")},
        "general": {k: v for k, v in kv.items() if k.startswith("general.")},
        "tensors": tensors, "experts": experts, "router": router_rows(path, r.tensors) if n_exp > 1 else {},
    }


def _n(x: int) -> str:
    return f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x:,}"


def _router_lines(r: dict) -> list[str]:
    """The router rows' distinctness a layer (gguf/router_rows.py), then any warning."""
    if not r:
        return []
    L = ["router rows (per layer: the closest pair of experts' rows, relative distance; the median pair's):"]
    L += [f"  layer {x['layer']:>3}: slots {x['pair'][0]} and {x['pair'][1]} {x['closest']:.4f}, median {x['median']:.4f}"
          for x in r["layers"]]
    return L + [f"warning: {w}" for w in r["warnings"]]


def format_inspect(info: dict) -> str:
    """Human-readable report of `inspect_gguf`'s dict."""
    prov = info["provenance"]
    L = [
        f"file          {info['path']} ({info['bytes'] / 1e6:.1f} MB)",
        f"model         {info['general'].get('general.name', '?')}",
        f"architecture  {info['architecture']}  layout {prov.get('mfgguf.layout', '?')}  quant {prov.get('mfgguf.quant', '?')}",
        f"parameters    {_n(info['params_total'])} total, {_n(info['params_active'])} active per token",
        f"experts       {info['n_experts']} (top-{info['top_k']}), router {prov.get('mfgguf.router', '-')}",
        "hyper-parameters:",
    ]
    L += [f"  {k} = {v}" for k, v in info["hparams"].items()]
    tok = info["tokenizer"]
    L.append(f"tokenizer     {tok.get('tokenizer.ggml.model')} / {tok.get('tokenizer.ggml.pre')}, "
             f"{tok.get('tokenizer.ggml.tokens', '?')}, eos {tok.get('tokenizer.ggml.eos_token_id')}")
    L.append(f"tensors ({info['n_tensors']}):")
    for t in info["tensors"]:
        note = f"  [{t['note']}]" if t["note"] else ""
        L.append(f"  {t['name']:<32} {t['type']:<5} {str(list(t['shape'])):<18} {t['bytes']:>12,} B @ {t['offset']}{note}")
    if info["experts"]:
        L.append("experts (slot: id, label, tokens trained, trunk; bytes, first..last byte):")
        for e in info["experts"]:
            lo = min(a for _, a, _ in e["ranges"])
            hi = max(b for _, _, b in e["ranges"])
            plain = e["label"] in (f"expert {e['id']}", f"slot {e['slot']}")  # a file of no names
            named = (("" if plain else f" {e['label']!r}") + (f", {e['tokens']:,} tokens" if e.get("tokens") else "")
                     + (f", trunk {e['trunk'][:12]}" if e.get("trunk") else ""))
            who = f"expert {e['id']:<4}" if e["id"] is not None else "seed       "
            L.append(f"  {e['slot']:>3}: {who}{named}; {e['bytes']:,} B in {len(e['ranges'])} ranges, {lo}..{hi}")
    L += _router_lines(info.get("router") or {})
    if (off := prov.get(schema.RS_OFFSET)) is not None:
        L.append(f"router stats  {info['bytes'] - int(off):,} B after the tensor data, at byte {off}: the experts' means"
                 f" and {len(prov.get(schema.RS_SOURCES) or [])} pooled second moment(s), for `mfgguf extend`")
    L.append("provenance:")
    for k, v in prov.items():
        if isinstance(v, list) and len(v) > 8:
            v = f"{v[:8]} ... ({len(v)} items)"
        L.append(f"  {k} = {v}")
    return "\n".join(L)
