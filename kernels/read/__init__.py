"""Read kernel: stored rows dequantized to a dense 16-bit (or fp32) buffer, for the sdpa prefill path."""
