"""Payload bytes: format, location coding, zstd, BLAKE2b-128 digest, strict decoding."""
