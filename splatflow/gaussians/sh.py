"""Real spherical-harmonics normalisation constants, bands 0-3: the one definition the rasterizer
(:mod:`splatflow.render.constants`), the file formats and the viewer share.

The sign convention is that of the 3DGS reference code and gsplat (basis 1 is -C1*y, basis 2 is C1*z, basis 3 is
-C1*x). A Gaussian's base colour is ``0.5 + SH_C0 * dc`` (its DC coefficient), in every format that stores one.
"""

SH_C0 = 0.28209479177387814  # Y_0^0 = 1 / (2 sqrt(pi)); colour = 0.5 + SH_C0 * dc (the DC term)
SH_C1 = 0.4886025119029199
SH_C2 = (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792, 0.5462742152960396)
SH_C3 = (
    -0.5900435899266435,
    2.890611442640554,
    -0.4570457994644658,
    0.3731763325901154,
    -0.4570457994644658,
    1.445305721320277,
    -0.5900435899266435,
)
