"""`specdec roofline` (specdec/roofline.py), kept for the commands in docs/benchmarks.md."""

from specdec.roofline import main

if __name__ == "__main__":
    main()
