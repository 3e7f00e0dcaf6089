"""Write small random-weight HF checkpoints of every supported Gemma variant (needs the `dev` extra).

    python scripts/make_random_checkpoints.py OUT_DIR [--seed 0]
"""

import argparse
from pathlib import Path

from specdec.models.random_init import all_variants, write_random_checkpoint

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for variant in all_variants():
        print(write_random_checkpoint(variant, args.out_dir / variant, args.seed))
