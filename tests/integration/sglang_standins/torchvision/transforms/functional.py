"""Import-only stand-in for torchvision.transforms.functional: see torchvision/__init__.py."""

from enum import Enum

from torchvision import missing_names


class InterpolationMode(Enum):
    """The real enum's members and values (sglang uses them as default arguments)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = missing_names(__name__)
