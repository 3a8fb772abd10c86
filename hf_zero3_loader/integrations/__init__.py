"""Ways to use hf_zero3_loader without changing `from_pretrained` call sites (accelerate launch, Trainer)."""
