"""Evaluation under the standard novel-view-synthesis protocol: the evaluate stage (``evaluate``), the
image metrics (``metrics``: PSNR, SSIM), LPIPS in plain torch (``lpips``) and the download of its
backbones on request (``weights``).
"""
