"""Model runner: KV tensors, batch preparation, forward and sampling."""
