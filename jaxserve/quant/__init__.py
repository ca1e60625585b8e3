"""Weight formats: the HF on-disk layouts (hf_formats) and jaxserve's runtime FP8/INT4 formats."""
