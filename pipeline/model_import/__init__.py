"""``bulk-classify model import``: model folders written from timm, torchvision and Hugging Face networks, each
checked against its framework's own transform and forward before it is kept (``core`` drives it, one module per
source)."""
