"""Weight-only quantization: int8 per output channel, int4 group-wise and fp8 (e4m3)
linear layers behind one interface (`QuantizedLinear`), loaded from GPTQ, AWQ,
compressed-tensors and fp8 checkpoints or quantized on the fly (`--quantization int8|int4|fp8`).

- `weight`: the canonical quantized weight, its plain dequantization, RTN quantization
- `formats`: checkpoint layouts -> canonical pieces (registry keyed by quant_method)
- `matmul`: the kernels that multiply a quantized weight, chosen per device
- `linear`: the layer; `install`: putting layers into a model before loading
"""
