"""A small model fed one large input (4 MiB): more than a tight per-session memory quota."""

from appkit import inputs, main
from torch import nn

if __name__ == "__main__":
    main(lambda: nn.Linear(1024, 4), inputs(1024, 1024), mode="no_grad", runs=1)
