"""Models: configuration, weights, tokenizer and the numpy reference forward.

config.py       ModelConfig, named shape presets, RoPE frequencies
checkpoint_config.py  ModelConfig from an HF config.json (and back) or GGUF metadata
weights.py      weights as {HF name: ndarray}: canonical shapes, checks, random weights
gguf_weights.py GGUF checkpoint loaders (float32 and bf16)
hf_weights.py   HF-directory (safetensors) loaders (float32 and bf16)
gguf_file.py    fast GGUF header parser (metadata + mapped tensor data)
tokenizer.py    tokenizers.Tokenizer from GGUF metadata or tokenizer.json; jinja2 chat template
registry.py     model spec -> ModelBundle; the default model (SmolLM2-135M-Instruct) and `pull`
llama_numpy.py  float32 forward over a paged KV cache (the emulated device's engine)
reference.py    float64 naive forward and a test-side paged batch driver
progress.py     text progress bar
__main__.py     `python -m blink.models`: inspect a model, generate greedily
"""
