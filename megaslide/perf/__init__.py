"""Performance accounting: model FLOPs and MFU, memory of a training step (what each op saves,
measured live bytes), host memory. Quality scores live in megaslide.eval."""
