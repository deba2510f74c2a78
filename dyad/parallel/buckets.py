"""How the gradient reduction cuts its work, in numbers the memory estimate
(`dyad/router/estimate.py`) reads too, without torch: the gradients one collective carries, and
how many of those buckets' copies live at once (`dyad/parallel/overlap.py`)."""

# Gradients summed per collective. The reduction's extra memory is a few buckets, where one flat
# copy of a group's gradients and a clone of it back cost twice the gradients (a 3 B-parameter
# LLM's float32 gradients are 12 GB: dp2 ran out of memory on an 80 GB GPU in that copy).
BUCKET_BYTES = 256 * 2**20

# Buckets' copies whose collective may still be running once the next one is sent: with the copy
# just made, one more than this lives at once, until the oldest is landed.
COPIES_IN_FLIGHT = 2
