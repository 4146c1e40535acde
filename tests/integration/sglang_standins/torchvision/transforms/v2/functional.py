"""Import-only stand-in for torchvision.transforms.v2.functional: see torchvision/__init__.py."""

from torchvision import missing_names

__getattr__ = missing_names(__name__)
