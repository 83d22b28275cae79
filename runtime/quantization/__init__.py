"""Weight-only quantization: int8 per output channel and int4 group-wise linear layers
behind one interface (`QuantizedLinear`), loaded from GPTQ, AWQ and compressed-tensors
checkpoints or quantized on the fly (`--quantization int8|int4`).

- `weight`: the canonical quantized weight, its plain dequantization, RTN quantization
- `formats`: checkpoint layouts -> canonical pieces (registry keyed by quant_method)
- `matmul`: the kernels that multiply a quantized weight, chosen per device
- `linear`: the layer; `install`: putting layers into a model before loading
"""
