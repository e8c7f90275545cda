"""torchvision's ImageFolder without hidden folders and files: .ipynb_checkpoints/ had become
a class, and macOS's ._IMG.jpg beside each photo an unreadable image; predict leaves them out
of a folder too. Its own module, imported where an image folder is read, so that torchvision
is imported only then and the class still pickles for spawned workers."""
from __future__ import annotations

from pathlib import Path

from torchvision import datasets
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from stages.data.datasets import visible_folders


class VisibleImageFolder(datasets.ImageFolder):
    def __init__(self, root: str, **kwargs) -> None:
        super().__init__(root, is_valid_file=lambda path: _visible_image(Path(root), path),
                         **kwargs)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        classes = [p.name for p in visible_folders(Path(directory))]
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: i for i, name in enumerate(classes)}


def _visible_image(root: Path, path: str) -> bool:
    return (has_file_allowed_extension(path, IMG_EXTENSIONS)
            and not any(part.startswith(".") for part in Path(path).relative_to(root).parts))
