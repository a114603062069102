"""spyre_rt: a simulated Spyre-like card as a PyTorch device."""


def _autoload() -> None:
    """Entry point of the ``torch.backends`` group: ``import torch`` registers the device."""
