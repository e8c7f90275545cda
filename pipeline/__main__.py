"""`python -m pipeline`, which torchrun needs to start the CLI."""
from pipeline.cli import main

if __name__ == "__main__":
    main()
