// Read a DICOM SEG the way web viewers do and report what they found.
//
//   node read_seg.mjs --reader dcmjs|cornerstone --seg SEG.dcm --ct CT.json [--labels OUT.raw]
//
// Readers:
//   dcmjs        dcmjs's adapters.Cornerstone.Segmentation.generateToolState (Cornerstone 4
//                tools' loader, the reader of OHIF 2 and of many dcmjs-based viewers);
//   cornerstone  @cornerstonejs/adapters' Cornerstone3D.Segmentation.createFromDICOMSegBuffer
//                (OHIF 3's SEG loader, extensions/cornerstone-dicom-seg).
// CT.json lists the source CT's instances (what a viewer's metadata provider knows of them):
//   [{sopInstanceUID, sopClassUID, seriesInstanceUID, frameOfReferenceUID, rows, columns,
//     imagePositionPatient, imageOrientationPatient, pixelSpacing, sliceThickness}, ...]
// in the order of the viewer's stack (the label map's slice order).
//
// Prints one JSON object: the reader, the segment numbers with their voxel counts, per stack
// slice the segments the reader placed there, the seconds the loader took (reading the file
// and building the label map) and the process's memory (peak resident set, and the resident
// set before and after the loader). With --labels the label map (segment numbers, uint16 little endian,
// slices x rows x columns in stack order) is written there, so that the caller can compare
// it voxel by voxel.

import fs from "node:fs";
import process from "node:process";

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith("--") || i + 1 >= argv.length) {
      throw new Error(`usage: read_seg.mjs --reader R --seg F --ct F [--labels F]; got ${argv[i]}`);
    }
    args[argv[i].slice(2)] = argv[i + 1];
  }
  for (const key of ["reader", "seg", "ct"]) {
    if (!args[key]) throw new Error(`--${key} is required`);
  }
  return args;
}

// What a viewer's metadata provider answers about the CT instances, keyed by imageId.
function metadataProvider(instances) {
  const modules = new Map();
  const imageIds = instances.map((ct, i) => {
    const imageId = `segnode:ct/${i}`;
    const [rowSpacing, columnSpacing] = ct.pixelSpacing.map(Number);
    const iop = ct.imageOrientationPatient.map(Number);
    const ipp = ct.imagePositionPatient.map(Number);
    modules.set(imageId, {
      imagePlaneModule: {
        frameOfReferenceUID: ct.frameOfReferenceUID,
        rows: ct.rows,
        columns: ct.columns,
        imageOrientationPatient: iop,
        rowCosines: iop.slice(0, 3),
        columnCosines: iop.slice(3, 6),
        imagePositionPatient: ipp,
        pixelSpacing: [rowSpacing, columnSpacing],
        rowPixelSpacing: rowSpacing,
        columnPixelSpacing: columnSpacing,
        sliceThickness: Number(ct.sliceThickness),
      },
      generalSeriesModule: { seriesInstanceUID: ct.seriesInstanceUID, modality: "CT" },
      generalImageModule: { sopInstanceUID: ct.sopInstanceUID, instanceNumber: i + 1 },
      sopCommonModule: { sopInstanceUID: ct.sopInstanceUID, sopClassUID: ct.sopClassUID },
      imagePixelModule: {
        rows: ct.rows,
        columns: ct.columns,
        samplesPerPixel: 1,
        bitsAllocated: 16,
        bitsStored: 12,
        highBit: 11,
        pixelRepresentation: 0,
        photometricInterpretation: "MONOCHROME2",
      },
      instance: {
        SOPInstanceUID: ct.sopInstanceUID,
        SOPClassUID: ct.sopClassUID,
        SeriesInstanceUID: ct.seriesInstanceUID,
        FrameOfReferenceUID: ct.frameOfReferenceUID,
        Rows: ct.rows,
        Columns: ct.columns,
        ImagePositionPatient: ipp,
        ImageOrientationPatient: iop,
        PixelSpacing: [rowSpacing, columnSpacing],
      },
    });
    return imageId;
  });
  const extra = new Map();
  const provider = {
    get(type, imageId) {
      const custom = extra.get(`${type}\u0000${imageId}`);
      if (custom !== undefined) return custom;
      return modules.get(imageId)?.[type];
    },
    add(imageId, type, value) {
      extra.set(`${type}\u0000${imageId}`, value);
    },
    addCustomMetadata(imageId, type, value) {
      extra.set(`${type}\u0000${imageId}`, value);
    },
  };
  return { imageIds, provider };
}

function arrayBufferOf(path) {
  const bytes = fs.readFileSync(path);
  return bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);
}

// dcmjs: one Uint16 label map of the whole stack (segment numbers), no overlap expected.
async function readDcmjs(imageIds, provider, segPath, sliceLength) {
  const dcmjs = (await import("dcmjs")).default;
  const started = process.hrtime.bigint();
  const result = dcmjs.adapters.Cornerstone.Segmentation.generateToolState(
    imageIds,
    arrayBufferOf(segPath),
    provider,
    false,
    1e-3,
  );
  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  if (!result) throw new Error("dcmjs returned no tool state");
  if (result.labelmapBufferArray.length !== 1) {
    throw new Error(`dcmjs found overlapping segments (${result.labelmapBufferArray.length} label maps)`);
  }
  const labels = new Uint16Array(result.labelmapBufferArray[0], 0, sliceLength * imageIds.length);
  return { seconds, labels };
}

// @cornerstonejs/adapters (OHIF 3): one derived label map image per stack slice.
async function readCornerstone(imageIds, provider, segPath, sliceLength) {
  const core = await import("@cornerstonejs/core");
  const adapters = await import("@cornerstonejs/adapters");
  core.metaData.addProvider((type, imageId) => provider.get(type, imageId), 10000);
  const started = process.hrtime.bigint();
  const result = await adapters.adaptersSEG.Cornerstone3D.Segmentation.createFromDICOMSegBuffer(
    imageIds,
    arrayBufferOf(segPath),
    { metadataProvider: provider, tolerance: 1e-3 },
  );
  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  if (result.overlappingSegments) throw new Error("cornerstone found overlapping segments");
  const images = result.labelMapImages[0];
  const labels = new Uint16Array(sliceLength * imageIds.length);
  images.forEach((image, k) => {
    const data = image.voxelManager
      ? image.voxelManager.getCompleteScalarDataArray?.() ?? image.voxelManager.getScalarData()
      : image.getPixelData();
    labels.set(data, k * sliceLength);
  });
  return { seconds, labels };
}

// Peak resident set of this process: VmHWM of /proc/self/status on Linux (the high-water
// mark of this program's memory; getrusage's maxRSS would keep that of the process that
// spawned node, across the exec), else getrusage's.
function peakRss() {
  try {
    const match = fs.readFileSync("/proc/self/status", "utf8").match(/^VmHWM:\s+(\d+) kB/m);
    if (match) return Number(match[1]) * 1024;
  } catch {
    // not Linux
  }
  return process.resourceUsage().maxRSS * 1024;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const instances = JSON.parse(fs.readFileSync(args.ct, "utf8"));
  const { imageIds, provider } = metadataProvider(instances);
  const sliceLength = instances[0].rows * instances[0].columns;
  const readers = { dcmjs: readDcmjs, cornerstone: readCornerstone };
  const read = readers[args.reader];
  if (!read) throw new Error(`unknown reader ${args.reader}`);
  // the libraries' own import, before the measured part
  if (args.reader === "dcmjs") await import("dcmjs");
  else await Promise.all([import("@cornerstonejs/core"), import("@cornerstonejs/adapters")]);
  const before = process.memoryUsage();
  const { seconds, labels } = await read(imageIds, provider, args.seg, sliceLength);
  const after = process.memoryUsage();
  const counts = {};
  const slices = [];
  for (let k = 0; k < imageIds.length; k++) {
    const present = new Set();
    const end = (k + 1) * sliceLength;
    for (let i = k * sliceLength; i < end; i++) {
      const n = labels[i];
      if (n) {
        counts[n] = (counts[n] ?? 0) + 1;
        present.add(n);
      }
    }
    slices.push([...present].sort((a, b) => a - b));
  }
  if (args.labels) {
    fs.writeFileSync(args.labels, Buffer.from(labels.buffer, labels.byteOffset, labels.byteLength));
  }
  const mib = (bytes) => Math.round((bytes / 2 ** 20) * 10) / 10;
  console.log(
    JSON.stringify({
      reader: args.reader,
      seconds: Math.round(seconds * 1e4) / 1e4,
      peak_rss_mib: mib(peakRss()),
      rss_before_mib: mib(before.rss),
      rss_after_mib: mib(after.rss),
      array_buffers_after_mib: mib(after.arrayBuffers),
      counts,
      slices,
    }),
  );
}

main().catch((error) => {
  console.error(error && error.stack ? error.stack : String(error));
  process.exit(1);
});
