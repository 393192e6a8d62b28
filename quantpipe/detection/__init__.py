"""The detection task (prepare.task: detection): data with boxes, the default detector, the
post-processing every variant and engine shares, and COCO scoring (pycocotools)."""
