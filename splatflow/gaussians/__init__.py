"""The Gaussian model every stage after sfm hands on: its parameters, checkpoint, one render of one
view and initialisation (``model``), and the spherical-harmonics constants the rasterizer, the file
formats and the viewer share (``sh``).
"""
