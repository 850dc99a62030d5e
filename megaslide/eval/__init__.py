"""Quality evaluation of generated videos: MovingShapes scores (motion.py), VBench's formulas
(video.py) and the real-VBench adapter (vbench_adapter.py). Performance accounting lives in megaslide.perf."""
