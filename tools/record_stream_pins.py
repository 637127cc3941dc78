"""Record the pinned Rolling Forcing streams (tests/stream_pins.py) into tests/data/rf_stream_pins.*.

Usage (from the repository root)::

    python -m tools.record_stream_pins            # check only: today's streams against the stored pins
    python -m tools.record_stream_pins --update   # rewrite tests/data/rf_stream_pins.{safetensors,json}

Provenance: the stored values are the two-pass absolute streams of the code before the method driver
(commit c83b89a), whose fp32 bits were pinned there by sha256 (:data:`C83B89A_SHA256`). ``--update``
refuses to write values that are not bitwise those streams unless ``--new-numerics`` says why the stream
changed on purpose (a deliberate numerics change of the shared ops); on a machine whose summation order
differs from the recording machine's it refuses too, so that the stored reference stays the one stream
the old pins named. The forward lists (exact facts) are rewritten from the code as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys

import torch

from tests import stream_pins as sp

C83B89A_SHA256 = {
    False: "65d00fecd268035ff7aadab9c34514316d02a3febc89cce37553a7318a506f8e",
    True: "20240617c62cac6d4b5a7624d4963a2ada19fcd60b6d315c7eadb0680c1a0aae",
}
"""sha256 of the fp32 bytes of ``REFERENCE_KEY`` 's streams at c83b89a (recorded on an AMD EPYC, AVX-512,
torch 2.13.0+cpu, one thread), keyed by ``switch``."""


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.record_stream_pins", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--update", action="store_true", help="rewrite tests/data/rf_stream_pins.*")
    ap.add_argument(
        "--new-numerics", default="", help="why the values may differ from c83b89a's (with --update)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = sp.tiny_model(sp.M)
    streams: dict[sp.Key, torch.Tensor] = {}
    facts: dict[str, list[str]] = {}
    with torch.no_grad():
        for key in sp.KEYS:
            streams[key], facts[sp.key_id(key)] = sp.drive(model, key)
    values = {s: streams[sp.REFERENCE_KEY[s]] for s in (False, True)}
    as_old = {s: _digest(values[s]) == C83B89A_SHA256[s] for s in (False, True)}
    worst = max(sp.max_err(streams[k], values[k[2]]) for k in sp.KEYS)
    print(f"reference streams bitwise equal to c83b89a's: {as_old}")
    print(f"max |key - reference of its prompt setting| over the 8 keys: {worst:.3g}")
    if not args.update:
        try:
            stored, stored_facts = sp.load_values(), sp.load_facts()
        except FileNotFoundError:
            print("no stored pins yet (--update writes them)")
            return 1
        errs = {sp.key_id(k): sp.max_err(streams[k], stored[k[2]]) for k in sp.KEYS}
        bad = [k for k, e in errs.items() if not e <= 1e-5 or facts[k] != stored_facts[k]]
        print(json.dumps(errs, indent=1))
        print("differing keys:", bad or "none")
        return 1 if bad else 0
    if not all(as_old.values()) and not args.new_numerics:
        print(
            "refusing to write: the reference streams are not c83b89a's bits (another CPU's summation "
            "order, or a numerics change: pass --new-numerics 'why')",
            file=sys.stderr,
        )
        return 1
    from safetensors.torch import save_file

    meta = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "bitwise_c83b89a": json.dumps(as_old),
        "new_numerics": args.new_numerics,
    }
    save_file(
        {sp.value_name(s): values[s].contiguous() for s in (False, True)}, str(sp.VALUES_FILE), metadata=meta
    )
    sp.FACTS_FILE.write_text(json.dumps({"meta": meta, "forwards": facts}, indent=1) + "\n")
    print(f"wrote {sp.VALUES_FILE} and {sp.FACTS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
