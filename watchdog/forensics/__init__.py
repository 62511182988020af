"""What is leaking, inside a training process: a census of what keeps memory alive (`census`),
who holds it (`holders`), what autograd graphs keep (`autograd_graphs`), where tensors were made
(`creation_sites`), and when each runs on the training thread (`follower`). Reads metadata only:
no device sync, no transfer, no compilation."""
