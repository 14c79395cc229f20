"""Data: raw rows -> tokenized examples (labels masked) -> packed or padded batches, cached."""
