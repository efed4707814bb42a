"""segnode: a DICOM node that segments CT series and returns DICOM SEG and TID 1500 SR."""

__version__ = "0.1.0"
