import 'uplot/dist/uPlot.min.css';
import './index.css';
