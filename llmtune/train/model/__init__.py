"""The model a rank trains: loading it (hub id, folder, GGUF), quantization (k-bit, QAT), adapters, attention and
loss kernels (varlen, Liger), linearized experts, and reading weight files one tensor at a time. May import
runtime/ and data/ (chat templates)."""
