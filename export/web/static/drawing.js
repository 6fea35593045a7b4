// A character drawn with a finger or a mouse, made into the 28x28 image the FEMNIST models
// read, as LEAF made its images: a form's box scaled down to 28x28 grayscale with 1.0 the
// white background and ink down to 0.0.
//
// Measured on the training examples of the FEMNIST slice (14,708 images; ink > 0.5):
// - the ink's centre of mass is at row 13.51, column 13.47 (sd 0.7): the image centre;
// - the longer side of the ink's bounding box is 8 px at the 10th percentile, 10 px at the
//   median and 13 px at the 90th;
// - a straight stroke ('1') holds about 1.6 px of full ink across.
// So the strokes are scaled about their box (a drawing that fills the guide square becomes
// the median 10 px, clamped to 8..13 px so a small or large drawing keeps some of its size),
// drawn 1.6 px wide with round ends, area-averaged from an 8x supersampled canvas (as PIL's
// antialiased thumbnail LEAF used), then moved so that the ink's centre of mass is the
// image centre.

export const SIZE = 28;
const CENTRE = 13.5;
const MEDIAN_SIDE = 10;
const SIDE_RANGE = [8, 13];
const STROKE_WIDTH = 1.6;
const SUPERSAMPLE = 8;
// The guide square's side, as a fraction of the drawing canvas.
export const GUIDE_FRACTION = 0.5;

// strokes: [[{x, y}, ...], ...] in canvas pixels of a `canvasSize` square. Returns
// Float32Array(784), row-major, or null without ink.
export function leafImage(strokes, canvasSize) {
  const points = strokes.flat();
  if (!points.length) return null;
  const xs = points.map((p) => p.x), ys = points.map((p) => p.y);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const extent = Math.max(x1 - x0, y1 - y0, 1e-6);
  const drawn = (MEDIAN_SIDE * extent) / (GUIDE_FRACTION * canvasSize);
  const side = Math.min(Math.max(drawn, SIDE_RANGE[0]), SIDE_RANGE[1]);
  const scale = extent > 1e-3 ? side / extent : 1;
  const centre = {x: (x0 + x1) / 2, y: (y0 + y1) / 2};
  let image = render(strokes, scale, centre, {x: 0, y: 0});
  const mass = centreOfMass(image);
  if (mass) image = render(strokes, scale, centre, {x: CENTRE - mass.x, y: CENTRE - mass.y});
  return image;
}

function render(strokes, scale, centre, shift) {
  const big = SIZE * SUPERSAMPLE;
  const canvas = new OffscreenCanvas(big, big);
  const ctx = canvas.getContext("2d", {willReadFrequently: true});
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, big, big);
  ctx.strokeStyle = ctx.fillStyle = "#000";
  ctx.lineWidth = STROKE_WIDTH * SUPERSAMPLE;
  ctx.lineCap = ctx.lineJoin = "round";
  const at = (p) => [
    ((p.x - centre.x) * scale + CENTRE + 0.5 + shift.x) * SUPERSAMPLE,
    ((p.y - centre.y) * scale + CENTRE + 0.5 + shift.y) * SUPERSAMPLE,
  ];
  for (const stroke of strokes) {
    const [sx, sy] = at(stroke[0]);
    if (stroke.length === 1) {
      ctx.beginPath();
      ctx.arc(sx, sy, ctx.lineWidth / 2, 0, 2 * Math.PI);
      ctx.fill();
      continue;
    }
    ctx.beginPath();
    ctx.moveTo(sx, sy);
    for (const p of stroke.slice(1)) ctx.lineTo(...at(p));
    ctx.stroke();
  }
  const pixels = ctx.getImageData(0, 0, big, big).data;
  const image = new Float32Array(SIZE * SIZE);
  for (let r = 0; r < big; r++) {
    for (let c = 0; c < big; c++) {
      image[Math.floor(r / SUPERSAMPLE) * SIZE + Math.floor(c / SUPERSAMPLE)] += pixels[(r * big + c) * 4];
    }
  }
  return image.map((v) => v / (255 * SUPERSAMPLE * SUPERSAMPLE));
}

// The ink's (1 - value) centre of mass {x: column, y: row}, or null for a blank image.
function centreOfMass(image) {
  let mass = 0, x = 0, y = 0;
  image.forEach((v, i) => {
    const ink = 1 - v;
    mass += ink;
    x += ink * (i % SIZE);
    y += ink * Math.floor(i / SIZE);
  });
  return mass > 0 ? {x: x / mass, y: y / mass} : null;
}

// Draws a 28x28 image (1.0 white) onto `canvas`, one canvas pixel per image pixel (CSS
// scales it up, pixelated).
export function showImage(canvas, image) {
  const ctx = canvas.getContext("2d");
  const data = ctx.createImageData(SIZE, SIZE);
  (image || new Float32Array(SIZE * SIZE).fill(1)).forEach((v, i) => {
    const g = Math.round(255 * v);
    data.data.set([g, g, g, 255], i * 4);
  });
  ctx.putImageData(data, 0, 0);
}

// Pointer strokes on `canvas` (mouse, finger, pen); `onStroke` after each one.
export class Pad {
  constructor(canvas, onStroke) {
    this.canvas = canvas;
    this.strokes = [];
    this.onStroke = onStroke;
    canvas.addEventListener("pointerdown", (e) => this.start(e));
    canvas.addEventListener("pointermove", (e) => this.move(e));
    for (const type of ["pointerup", "pointercancel"]) canvas.addEventListener(type, (e) => this.end(e));
    this.redraw();
  }

  point(e) {
    const box = this.canvas.getBoundingClientRect();
    return {x: ((e.clientX - box.left) / box.width) * this.size, y: ((e.clientY - box.top) / box.height) * this.size};
  }

  get size() {
    return this.canvas.width;
  }

  start(e) {
    e.preventDefault();
    this.canvas.setPointerCapture(e.pointerId);
    this.current = [this.point(e)];
    this.strokes.push(this.current);
    this.redraw();
  }

  move(e) {
    if (!this.current) return;
    e.preventDefault();
    this.current.push(this.point(e));
    this.redraw();
  }

  end(e) {
    if (!this.current) return;
    this.current = null;
    this.onStroke();
  }

  clear() {
    this.strokes = [];
    this.redraw();
  }

  image() {
    return leafImage(this.strokes, this.size);
  }

  redraw() {
    const ctx = this.canvas.getContext("2d");
    const s = this.size;
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, s, s);
    const g = (s * (1 - GUIDE_FRACTION)) / 2;
    ctx.setLineDash([s / 60, s / 60]);
    ctx.strokeStyle = "#c9d3df";
    ctx.lineWidth = Math.max(1, s / 300);
    ctx.strokeRect(g, g, s * GUIDE_FRACTION, s * GUIDE_FRACTION);
    ctx.setLineDash([]);
    ctx.strokeStyle = ctx.fillStyle = "#111";
    ctx.lineWidth = s / 22;
    ctx.lineCap = ctx.lineJoin = "round";
    for (const stroke of this.strokes) {
      ctx.beginPath();
      ctx.moveTo(stroke[0].x, stroke[0].y);
      for (const p of stroke.slice(1)) ctx.lineTo(p.x, p.y);
      if (stroke.length === 1) ctx.lineTo(stroke[0].x + 0.01, stroke[0].y);
      ctx.stroke();
    }
  }
}
