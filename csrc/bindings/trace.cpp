// Timeline and flight recorder (trace/recorder.h) for python/rumor/timeline.py.
#include <pybind11/stl.h>

#include <cstring>

#include "bindings/common.h"
#include "comm/context.h"
#include "trace/recorder.h"

namespace rumor::bindings {

namespace {

trace::Category category_of(const std::string& cat) {
  if (cat == "user") return trace::Category::kUser;
  if (cat == "phase") return trace::Category::kPhase;
  if (cat == "bucket") return trace::Category::kBucket;
  if (cat == "codec") return trace::Category::kCodec;
  if (cat == "wait") return trace::Category::kWait;
  if (cat == "comm") return trace::Category::kComm;
  throw Error(ErrorKind::kInvalidArgument,
              "timeline: unknown category '" + cat + "' (expected user, phase, bucket, codec, wait or comm)");
}

template <size_t N>
void fill(char (&dst)[N], const std::string& s) {
  size_t n = std::min(s.size(), N - 1);
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

}  // namespace

void bind_trace(py::module_& m) {
  m.def("trace_now_us", &trace::now_us);
  m.def(
      "timeline_start",
      [](Context& ctx, const std::string& path, double offset_us, double rtt_us) {
        py::gil_scoped_release nogil;
        ctx.recorder().start(path, offset_us, rtt_us);
      },
      py::arg("ctx"), py::arg("path"), py::arg("offset_us") = 0.0, py::arg("rtt_us") = 0.0);
  m.def("timeline_stop", [](Context& ctx) {
    py::gil_scoped_release nogil;
    ctx.recorder().stop();
  });
  m.def("timeline_flush", [](Context& ctx) {
    py::gil_scoped_release nogil;
    ctx.recorder().flush();
  });
  m.def("timeline_active", [](Context& ctx) { return ctx.recorder().active(); });
  m.def("timeline_path", [](Context& ctx) { return ctx.recorder().path(); });
  m.def("timeline_dropped", [](Context& ctx) { return ctx.recorder().dropped(); });
  m.def("timeline_name_thread",
        [](Context& ctx, const std::string& name) { ctx.recorder().name_thread(name); });
  // ph: "X" (ts, dur) or "i" (ts). args: the body of a JSON object, already encoded; left out
  // when it does not fit an event.
  m.def(
      "timeline_emit",
      [](Context& ctx, const std::string& name, const std::string& cat, double ts_us, double dur_us,
         const std::string& ph, const std::string& args) {
        if (ph != "X" && ph != "i")
          throw Error(ErrorKind::kInvalidArgument, "timeline: ph must be 'X' or 'i', got '" + ph + "'");
        trace::Recorder& rec = ctx.recorder();
        if (!rec.active()) return;
        trace::Event e;
        e.ph = ph[0];
        e.cat = category_of(cat);
        e.ts = ts_us;
        e.dur = dur_us;
        fill(e.name, name);
        if (args.size() < sizeof(e.args)) fill(e.args, args);
        rec.emit(e);
      },
      py::arg("ctx"), py::arg("name"), py::arg("cat"), py::arg("ts_us"), py::arg("dur_us") = 0.0,
      py::arg("ph") = "X", py::arg("args") = "");
  m.def("flight_records", [](Context& ctx) {
    py::list out;
    for (const trace::FlightEntry& f : ctx.recorder().flight_records()) {
      py::dict d;
      d["seq"] = f.seq;
      d["name"] = f.name;
      d["comm"] = f.comm;
      d["tag"] = f.tag;
      d["bytes"] = f.bytes;
      d["peer"] = f.peer >= 0 ? py::object(py::int_(f.peer)) : py::object(py::none());
      d["ranks"] = f.ranks;
      d["state"] = trace::state_name(f.state);
      // Seconds on the steady clock (time.monotonic()); None when not reached.
      d["queued"] = f.t_begin / 1e6;
      d["started"] = f.t_start > 0 ? py::object(py::float_(f.t_start / 1e6)) : py::object(py::none());
      d["ended"] = f.t_end > 0 ? py::object(py::float_(f.t_end / 1e6)) : py::object(py::none());
      d["error"] = f.error.empty() ? py::object(py::none()) : py::object(py::str(f.error));
      out.append(d);
    }
    return out;
  });
  m.def("flight_capacity", [](Context& ctx) { return ctx.recorder().flight_capacity(); });
  m.def("flight_dump", [](Context& ctx, const std::string& why) {
    py::gil_scoped_release nogil;
    ctx.recorder().dump_flight(why);
  });
}

}  // namespace rumor::bindings
