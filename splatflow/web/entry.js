// The 3D viewer embedded in a splatflow report: Spark (a maintained three.js Gaussian splat renderer) draws the
// splat, three's OrbitControls move the camera. esbuild bundles this file with its dependencies into one script
// that the report inlines, so the page works from the file alone (file://, no network, no import maps).
//
// window.SplatflowViewer.mount(element, options) with
//   bytes:     Uint8Array of the splat file (the report embeds it base64-encoded)
//   fileType:  "spz" | "ply" | "splat"
//   meshMatrix: 16 numbers, column-major: the splat's object-to-world matrix (the report's frame conversion)
//   cameras:   [{name, matrix (16, column-major camera-to-world in three's convention), fovY (deg), aspect}]
//   target:    [x, y, z] orbit centre
// The element gets data-state="loading" | "ready" | "error" (with data-error) and data-frames (animation frames
// drawn with splats). "ready" means a frame has been drawn with splats in it, not merely that the file decoded:
// Spark sorts the splats in a web worker and draws nothing (instance count 0) until the first sort result comes
// back, so a page (or a test) that trusted the decode alone would look at an empty canvas.
import * as THREE from "three";
import { OrbitControls } from "three/addons/controls/OrbitControls.js";
import { SparkRenderer, SplatMesh } from "@sparkjsdev/spark";

function mount(element, options) {
  element.dataset.state = "loading";
  element.dataset.frames = "0";
  const width = element.clientWidth || 640;
  const height = element.clientHeight || 480;
  const renderer = new THREE.WebGLRenderer({ antialias: false, preserveDrawingBuffer: true });
  renderer.setPixelRatio(1);
  renderer.setSize(width, height);
  renderer.setClearColor(new THREE.Color(options.background || "#101418"), 1);
  element.appendChild(renderer.domElement);

  const scene = new THREE.Scene();
  const cams = options.cameras || [];
  const first = cams[0];
  const camera = new THREE.PerspectiveCamera(first ? first.fovY : 50, width / height, 0.01, 1000);
  const controls = new OrbitControls(camera, renderer.domElement);
  controls.enableDamping = false;

  function flyTo(cam) {
    const m = new THREE.Matrix4().fromArray(cam.matrix);
    camera.position.setFromMatrixPosition(m);
    camera.quaternion.setFromRotationMatrix(m);
    camera.up.set(0, 1, 0).applyQuaternion(camera.quaternion);  // orbit about the camera's own up
    camera.fov = cam.fovY;
    camera.updateProjectionMatrix();
    // Orbit around the point the camera looks at, at the distance of the scene centre.
    const target = new THREE.Vector3().fromArray(options.target || [0, 0, 0]);
    const forward = new THREE.Vector3(0, 0, -1).applyQuaternion(camera.quaternion);
    const dist = Math.max(1e-3, target.clone().sub(camera.position).dot(forward));
    controls.target.copy(camera.position.clone().add(forward.multiplyScalar(dist)));
    controls.update();
    camera.quaternion.setFromRotationMatrix(m);  // OrbitControls.update may re-derive it; keep the exact pose
  }
  if (first) flyTo(first);

  const spark = new SparkRenderer({ renderer });
  scene.add(spark);
  const mesh = new SplatMesh({ fileBytes: options.bytes, fileType: options.fileType });
  if (options.meshMatrix) {
    mesh.matrixAutoUpdate = false;
    mesh.matrix.fromArray(options.meshMatrix);
  }
  scene.add(mesh);

  let frames = 0;
  let decoded = false;
  mesh.initialized.then(() => {
    decoded = true;
  }).catch((err) => {
    element.dataset.state = "error";
    element.dataset.error = String(err);
    console.error("splatflow viewer:", err);
  });
  renderer.setAnimationLoop(() => {
    controls.update();
    renderer.render(scene, camera);
    // spark.activeSplats is the instance count the frame just drawn used (0 until the worker's first sort).
    if (decoded && spark.activeSplats > 0) {
      frames += 1;
      element.dataset.frames = String(frames);
      if (element.dataset.state === "loading") element.dataset.state = "ready";
    }
  });
  return { flyTo, camera, controls, mesh, renderer };
}

window.SplatflowViewer = { mount, THREE };
