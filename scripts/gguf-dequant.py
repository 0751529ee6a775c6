#!/usr/bin/env python3
"""gguf-dequant.py SRC DST f32|f16 -- a copy of a GGUF model with every
tensor dequantized (gguf-py's reference dequantization) and stored as f32,
or as f16 for the matrices (vectors stay f32): the exact-arithmetic models
for attributing rounding (docs/gpu.md, test-gpu-e2e's poem checks). Needs
`pip install gguf numpy`.
"""
import sys

import gguf
import numpy as np


def main():
    if len(sys.argv) != 4 or sys.argv[3] not in ("f32", "f16"):
        sys.exit(__doc__)
    src, dst, typ = sys.argv[1:]
    r = gguf.GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            et = f.types[1]
            if et == gguf.GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(name, vals, vt, sub_type=et)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(f.parts[-1]).decode("utf-8", errors="surrogateescape"), vt)
        else:
            w.add_key_value(name, f.parts[-1].tolist()[0], vt)
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        x = x.reshape(tuple(int(s) for s in reversed(t.shape.tolist())))
        w.add_tensor(t.name, x.astype(np.float16) if typ == "f16" and x.ndim == 2 else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
