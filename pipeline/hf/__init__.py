"""Hugging Face transformers classes for the project's GPT (configuration_fpa, modeling_fpa); the two
files are copied into an `fpa export --format hf` directory and loaded from there with
trust_remote_code=True. Importing this package needs transformers (`pip install -e .[hf]`)."""
