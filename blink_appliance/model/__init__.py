"""Model code: config, the Llama-family transformer, the paged KV cache, loaders, tokenizer."""
