"""Import-only stand-in for torchvision.io: see torchvision/__init__.py."""

from torchvision import missing_names

__getattr__ = missing_names(__name__)
