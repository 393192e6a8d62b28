"""The segmentation task's library (prepare.task: segmentation): digit canvases with per-pixel
masks and mask folders (data.py), the own segmenter and torchvision's adapted (model.py), and
mIoU, per-class IoU and pixel accuracy by torchmetrics (metrics.py)."""
