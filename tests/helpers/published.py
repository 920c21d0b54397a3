"""A user's checkout of Lightning's repository with its two MNIST examples, byte for byte (tests/data/published).

:func:`lightning_checkout` copies ``tests/data/published/lightning`` into a folder and writes MNIST
where each script looks for it: ``Datasets/`` at the top (train_fabric.py: three folders above its
own file), ``examples/Datasets`` (backbone_image_classifier.py: two folders above), and ``./data`` of
the folder its docstring runs it from (Lightning's MNIST wrapper tries ``./data`` first).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.helpers.cli import REPO
from tests.helpers.mnist_files import link_mnist, write_mnist

PUBLISHED = REPO / "tests" / "data" / "published" / "lightning"
#: The folders their authors run them from, relative to the checkout, and the script in each.
BACKBONE = ("examples/pytorch/basics", "backbone_image_classifier.py")
FABRIC = ("examples/fabric/image_classifier", "train_fabric.py")
#: LightningCLI options that make the published Trainer a short run (the user's own ARGS, not an edit).
SHORT_TRAINER = ("--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--trainer.limit_train_batches=3",
                 "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2", "--trainer.limit_predict_batches=2",
                 "--trainer.enable_progress_bar=false")
#: train_fabric.py's own quick check: one batch of training and one of testing.
SHORT_FABRIC = ("--dry-run", "--epochs", "1")


def lightning_checkout(folder: Path) -> Path:
    """The checkout (``folder``), its MNIST files written and linked where the scripts look."""
    shutil.copytree(PUBLISHED, folder)
    mnist = write_mnist(folder / "Datasets").parent
    link_mnist(folder / "examples" / "Datasets", mnist)
    link_mnist(folder / BACKBONE[0] / "data", mnist)
    return folder


def tree(folder: Path) -> set[str]:
    """Every path under ``folder`` (relative), not following links."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}
