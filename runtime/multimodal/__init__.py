"""Image input: loading what clients send, turning it into prompt placeholders and pixel values."""
